"""Per-arm peak memory: arms trained one after another vs one arm alone ([Note: arms one at a
time], qwz/qualify/run/runner.py).

Trains, on 2 gloo ranks, a ~100M-parameter MLP (large enough that the model and optimizer
state dominate the Python and torch baseline) for a few steps:

* *alone*: each arm in a fresh pair of rank processes, by itself;
* *in sequence*: reference, calibration and candidate arms one after another in the same
  processes, as a qualification runs them, each from a reset of the peak.

It prints, per arm, the largest per-rank peak RSS in both settings and their ratio (the
qualification's claim: within 10%), the peak of the whole sequence (each arm's peak is
measured from a reset, and the resets cover the whole run), and the sum of the arms alone:
roughly what holding every arm at once would take. Printed, never asserted.

    python benchmarks/arm_memory.py [--hidden 8192] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.run import runner
from qwz.qualify.run.launch import LocalWorld
from qwz.qualify.run.workloads import Workload

GIB = 1024**3


def train_arms(plan: RunPlan, names: list[str]) -> dict[str, object]:
    """On every rank: train the named arms of `plan` in order; their peaks, and the process's."""
    rank = runner._rank_and_world()[0]
    peaks = {}
    for arm in plan.arms:
        if arm.name in names:
            observation, _ = runner._train_arm(plan, arm, rank, None, None, runner._Progress(False))
            assert observation.failure is None, observation.failure
            peaks[arm.name] = observation.memory["peak_allocated_bytes"]
    return {"arms": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    hidden = args.hidden
    workload = Workload("mlp", {"sizes": [1024, hidden, hidden, 1024], "micro_batch": 8})
    plan = RunPlan(workload=workload, steps=args.steps, blocks=0, eval_every=args.steps)
    plan = dataclasses.replace(plan, held_out_batches=1)
    names = [arm.name for arm in plan.arms]
    numel = 1024 * hidden * 2 + hidden * hidden + 2 * hidden + 1024
    print(f"mlp {numel / 1e6:.0f}M parameters, 2 gloo ranks, {args.steps} steps per arm")

    alone = {}
    for name in names:
        with LocalWorld(2) as world:
            results = world.run(train_arms, plan, [name])
        alone[name] = max(result["arms"][name] for result in results)
    with LocalWorld(2) as world:
        results = world.run(train_arms, plan, names)
    in_sequence = {name: max(result["arms"][name] for result in results) for name in names}

    print(f"| arm | peak RSS alone | peak RSS in sequence of {len(names)} | ratio |")
    print("|---|---|---|---|")
    for name in names:
        ratio = in_sequence[name] / alone[name]
        print(
            f"| `{name}` | {alone[name] / GIB:.2f} GiB | {in_sequence[name] / GIB:.2f} GiB "
            f"| {ratio:.3f} |"
        )
    print(
        f"peak RSS of the whole sequence (largest rank): {max(in_sequence.values()) / GIB:.2f} "
        f"GiB; sum of the arms alone: {sum(alone.values()) / GIB:.2f} GiB"
    )


if __name__ == "__main__":
    main()
