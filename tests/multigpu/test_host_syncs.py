"""The engine's step on two gloo ranks reads the device on the host only where its
semantics need a value there ([Note: host reads in a step], qwz/optimizer.py): the same two
reads per step as on one rank (tests/unit/core/test_host_syncs.py), with the quantized
gather's collectives and the reductions in between, and one read for an fp16 overflow that
only one rank saw (every rank skips, every rank's ``engine.step()`` returns False)."""

from __future__ import annotations

import pytest

from tests.unit.core.host_reads import GRADIENT_FINITE, MASTERS_IN_RANGE, run_counted

pytestmark = pytest.mark.multigpu

TAKEN = [GRADIENT_FINITE, MASTERS_IN_RANGE]


def counted_steps(dtype: str, stage: int, overflow_at: int | None) -> dict:
    """Rank body: each step's qwz reads and whether it stepped, and torch's foreign reads."""
    steps, foreign = run_counted(dtype, stage, steps=3, overflow_at=overflow_at, overflow_rank=1)
    return {
        "stepped": [step.stepped for step in steps],
        "reads": [step.qwz for step in steps],
        "foreign": [read.where for read in foreign],
    }


@pytest.mark.parametrize(
    "dtype, stage, overflow_at", [("bf16", 1, None), ("bf16", 2, None), ("fp16", 2, 2)]
)
def test_two_ranks_read_only_what_the_step_s_semantics_need(worlds, dtype, stage, overflow_at):
    results = worlds.get(2).run(counted_steps, dtype, stage, overflow_at)
    skipped = [GRADIENT_FINITE]  # an fp16 overflow skip: no gather, no second read
    for rank, result in enumerate(results):
        expected = [skipped if step == overflow_at else TAKEN for step in (1, 2, 3)]
        assert result["reads"] == expected, f"rank {rank}: {result['reads']}"
        assert result["stepped"] == [step != overflow_at for step in (1, 2, 3)], rank
        assert result["foreign"] == [], rank
