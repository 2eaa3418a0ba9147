"""Timing the arms in order-balanced blocks ([Note: order-balanced blocks], evidence/stats.py).

Nothing here knows about processes: the caller passes the step functions and a ``sync`` (a
barrier, ``torch.cuda.synchronize``) so that a step's time is the time until every rank has
finished it. The statistics of the times are evidence/stats.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from qwz.qualify.evidence.stats import BlockTiming, require_count


def measure_blocks(
    run_reference: Callable[[], object],
    run_candidate: Callable[[], object],
    *,
    blocks: int,
    block_steps: int,
    warmup_steps: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] = lambda: None,
) -> list[BlockTiming]:
    """Time both arms in ``blocks`` order-balanced blocks ([Note: order-balanced blocks]).

    ``run_reference`` and ``run_candidate`` each run one training step. Block
    ``i`` runs the reference first when ``i`` is even (``AB``) and the candidate
    first when it is odd (``BA``). Per arm and block: ``warmup_steps`` untimed
    steps, then ``block_steps`` steps each timed as ``sync(); t0 = clock();
    step(); sync(); t1 = clock()``. A step function may return a reading, a callable
    called after that closing sync whose value is the step's gather seconds (or None).
    """
    require_count("blocks", blocks, 1)
    require_count("block_steps", block_steps, 1)
    require_count("warmup_steps", warmup_steps, 0)

    def timed_steps(run_step: Callable[[], object]) -> tuple[list[float], list[float | None]]:
        for _ in range(warmup_steps):
            run_step()
        step_times_s, gather_times_s = [], []
        for _ in range(block_steps):
            sync()
            start_s = clock()
            reading = run_step()
            sync()
            step_times_s.append(clock() - start_s)
            gather_times_s.append(reading() if callable(reading) else None)
        return step_times_s, gather_times_s

    timings = []
    for block_index in range(blocks):
        if block_index % 2 == 0:
            reference = timed_steps(run_reference)
            candidate = timed_steps(run_candidate)
            order = "AB"
        else:
            candidate = timed_steps(run_candidate)
            reference = timed_steps(run_reference)
            order = "BA"
        timings.append(BlockTiming(order, reference[0], candidate[0], reference[1], candidate[1]))
    return timings
