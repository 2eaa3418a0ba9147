"""On the ranks: build each arm (subjects), train and observe it (runner, observers), time the
pairs (timing), under deterministic settings (determinism), on a workload (workloads)."""
