"""On the ranks: build each arm (subjects), train it and hear its observers (arm_run,
observers), the rank's run of every arm then the timing (runner, timing), under deterministic
settings (determinism), on a workload (workloads); and how ranks are started (launch, and
torchrun's own protocol: torchrun)."""
