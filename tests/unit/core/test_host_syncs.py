"""The engine's step reads the device on the host only where its semantics need a value
there ([Note: host reads in a step], qwz/optimizer.py), counted on one rank by
:class:`~tests.unit.core.host_reads.HostReads` (tests/multigpu/test_host_syncs.py: two
ranks). Each read a step may make is named; any other read of a tensor value by qwz's code
in backward() or step() fails the test, naming where it was made."""

from __future__ import annotations

import pytest

from .host_reads import GRADIENT_FINITE, MASTERS_IN_RANGE, run_counted

STEPS = 3
TAKEN = [GRADIENT_FINITE, MASTERS_IN_RANGE]
"""A step taken: whether the gradient is finite, whether the updated masters are in range."""
SKIPPED = [GRADIENT_FINITE]
"""An fp16 overflow skip: the first read answers ``engine.step()`` (False), and no gather
runs, so the second is never made."""


@pytest.mark.parametrize(
    "dtype, stage, accumulation, fused_kernels",
    [
        ("bf16", 2, 1, False),
        ("bf16", 1, 1, None),  # the fused kernels (native on CPU) where they serve
        ("fp32", 1, 2, False),  # two micro-batches: the first one's backward and step read none
        ("fp32", 2, 2, False),
        ("fp16", 2, 1, False),
    ],
)
def test_a_step_reads_only_what_its_semantics_need(dtype, stage, accumulation, fused_kernels):
    steps, foreign = run_counted(
        dtype, stage, steps=STEPS, accumulation=accumulation, fused_kernels=fused_kernels
    )
    for index, step in enumerate(steps, start=1):
        assert step.stepped
        assert step.qwz == TAKEN, f"step {index}: {step.qwz}"
    assert foreign == [], "torch read tensors other than its optimizer's step counters"


def test_an_fp16_overflow_skip_reads_once_and_returns_false():
    steps, foreign = run_counted("fp16", 2, steps=STEPS, overflow_at=2)
    assert [step.stepped for step in steps] == [True, False, True]
    assert [step.qwz for step in steps] == [TAKEN, SKIPPED, TAKEN]
    assert foreign == []


def test_the_counter_sees_a_read_of_the_norm_in_the_step():
    """The counter's power: a ``float()`` of the gradient norm in qwz's code during the step
    (here the engine's own property, read inside the counted window) is seen and named."""
    steps, _ = run_counted("bf16", 2, steps=2, extra_read=True)
    for step in steps:
        assert step.qwz == [*TAKEN, ("qwz/engine.py:global_grad_norm", "__float__")]
