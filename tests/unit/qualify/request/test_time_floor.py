"""[Note: the time floor] (qwz/qualify/request/time_floor.py): a ``--timeout`` the run cannot
meet is refused before any rank starts (issue 49: ``--timeout 8`` trained for 8 s, then ended
``FAIL: finite[reference]``), and no run's own default limit ever is."""

from __future__ import annotations

import pytest

from qwz.qualify.base import presets
from qwz.qualify.request import settings
from qwz.qualify.request.time_floor import (
    CPU_STEP_FLOOR_S,
    RANKS_START_S,
    time_floor,
    timeout_problem,
)

DEFAULT_RUN = {"arms": 4, "timed_candidates": 1, "steps": 20, "blocks": 4, "warmup_steps": 2,
               "block_steps": 5}  # fmt: skip
"""The main job's run: reference, calibration, candidate and chunked candidate; the
candidate timed against the reference in 4 blocks of 2 + 5 steps each."""


def test_the_main_jobs_run_cannot_finish_in_8_s():
    floor = time_floor(workload="qwen3-tiny", on_cpu=True, **DEFAULT_RUN)
    assert floor.steps == 4 * 20 + 4 * 2 * (2 + 5)
    assert floor.seconds == pytest.approx(RANKS_START_S + 136 * CPU_STEP_FLOOR_S["qwen3-tiny"])
    problem = timeout_problem(8, floor, "qwen3-tiny")
    assert problem == (
        "--timeout 8: shorter than this run can take (at least 9.6 s: 136 steps of qwen3-tiny "
        "at 0.063 s or more each on a CPU rank, after 1 s to start the ranks); the limit "
        "bounds the whole run: give more, e.g. --timeout 100"
    )
    assert timeout_problem(floor.seconds, floor, "qwen3-tiny") is None


def test_on_gpus_only_the_ranks_start_is_counted():
    floor = time_floor(workload="qwen3-tiny", on_cpu=False, **DEFAULT_RUN)
    assert (floor.seconds, floor.step_s) == (RANKS_START_S, 0.0)
    assert timeout_problem(0.5, floor, "qwen3-tiny").startswith(
        "--timeout 0.5: shorter than this run can take (at least 1.0 s: 1 s to start the ranks)"
    )


@pytest.mark.parametrize("preset", sorted(presets.PRESETS))
@pytest.mark.parametrize("workload", sorted(CPU_STEP_FLOOR_S))
def test_no_preset_is_refused_with_the_default_timeout(preset, workload):
    """The floor may refuse only what the user asked for: every preset's own horizon, with
    three candidates and the declared default --timeout, is well within it."""
    values = {**{n: s.default for n, s in settings.run_settings().items()},
              **presets.PRESETS[preset].values}  # fmt: skip
    floor = time_floor(
        workload=workload,
        arms=1 + 1 + 3 + 1,
        timed_candidates=3,
        steps=values["steps"],
        blocks=values["blocks"],
        warmup_steps=values["warmup_steps"],
        block_steps=values["block_steps"],
        on_cpu=True,
    )
    assert timeout_problem(values["timeout"], floor, workload) is None
