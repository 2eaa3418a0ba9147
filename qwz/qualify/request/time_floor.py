"""The least time a ``run`` of local ranks can take, so a ``--timeout`` it cannot meet is
refused before any rank starts.

[Note: the time floor]
``--timeout`` bounds the whole run of local ranks (qualify/run/launch.py): starting them,
every arm one after another, then the speed blocks. A run whose limit is shorter than that
can only end TIMED-OUT ([Note: unfinished runs] in evidence/unfinished.py) after spending
the limit, so the preflight refuses it with this estimate: a floor, not a forecast.

    floor = RANKS_START_S + steps x step seconds of the workload on a CPU rank
    steps = arms x --steps + timed candidates x --blocks x 2 arms x (--warmup-steps +
            --block-steps)

The step seconds (:data:`CPU_STEP_FLOOR_S`) are a training step of the reference arm (the
arm that observes least) measured on the 2-core CPU runner, divided by
:data:`FLOOR_MARGIN` for a faster, idle CPU; held-out evaluations and the record are not
counted. On GPUs (NCCL ranks) and for workloads the table does not list, a step counts 0,
so only the ranks' start is refused. Under torchrun ``--timeout`` bounds each collective,
not the run, and nothing is refused here. A limit above the floor may still run out: the
verdict then names it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

RANKS_START_S = 1.0
"""Forking the ranks, their rendezvous and the first arm's engine: at least this."""
FLOOR_MARGIN = 3.0
CPU_STEP_FLOOR_S = {
    "mlp": 0.06 / FLOOR_MARGIN,
    "mlp-small": 0.053 / FLOOR_MARGIN,
    "qwen3-tiny": 0.19 / FLOOR_MARGIN,
}
"""Seconds of one reference-arm step on a gloo rank (2-core CPU runner) / FLOOR_MARGIN."""
SUGGESTED_TIMES_FLOOR = 10
"""A refusal suggests this multiple of the floor: room for a busy machine and the
evaluations the floor does not count."""


class TimeFloor(NamedTuple):
    seconds: float
    steps: int
    """Training and timed steps of every arm together."""
    step_s: float


def time_floor(
    *,
    workload: str,
    arms: int,
    timed_candidates: int,
    steps: int,
    blocks: int,
    warmup_steps: int,
    block_steps: int,
    on_cpu: bool,
) -> TimeFloor:
    """[Note: the time floor] of a run of `arms` arms, `timed_candidates` of them timed."""
    timed = timed_candidates * blocks * 2 * (warmup_steps + block_steps) if blocks else 0
    total = arms * steps + timed
    step_s = CPU_STEP_FLOOR_S.get(workload, 0.0) if on_cpu else 0.0
    return TimeFloor(RANKS_START_S + total * step_s, total, step_s)


def timeout_problem(timeout_s: float, floor: TimeFloor, workload: str) -> str | None:
    """Why `timeout_s` cannot be met (one line), or None."""
    if timeout_s >= floor.seconds:
        return None
    counted = (
        f"{floor.steps} steps of {workload} at {floor.step_s:.3f} s or more each on a CPU "
        "rank, after "
        if floor.step_s
        else ""
    )
    suggestion = 10 * math.ceil(SUGGESTED_TIMES_FLOOR * floor.seconds / 10)
    return (
        f"--timeout {timeout_s:g}: shorter than this run can take (at least "
        f"{floor.seconds:.1f} s: {counted}{RANKS_START_S:g} s to start the ranks); the limit "
        f"bounds the whole run: give more, e.g. --timeout {suggestion}"
    )
