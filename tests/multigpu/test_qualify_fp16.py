"""fp16 qualification on two real ranks: overflow-skipped steps are legitimate, broken
candidates are not ([Note: overflow pattern], qwz/qualify/evidence/rules/overflow_pattern.py).

The plan starts the loss scale high (2**18 on the mlp workload: its first two steps
overflow, one spending the hysteresis, one halving the scale) with a short window (3), so
the scale doubles back within the window and overflows again: every rule of dynamic loss
scaling is exercised in 8 steps. The correct candidate must PASS with overflow-skipped
steps recorded; each fp16 mutant of ``mutants.FP16_KILLED_BY`` must FAIL, named by its
check. DeepSpeed refuses fp16 on CPUs without AVX512-FP16, so this runs qwz's engine.
"""

from __future__ import annotations

import dataclasses

import pytest

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload

from . import mutants

pytestmark = pytest.mark.multigpu

CANDIDATE = "candidate-g64"
PLAN = RunPlan(
    workload=get_workload("mlp"),
    dtype="fp16",
    steps=8,
    blocks=0,
    eval_every=2,
    allgather_bucket_size=100_000,
    fp16_initial_scale_power=18,
    fp16_loss_scale_window=3,
)


def qualify(worlds, mutant: str | None = None, **changes):
    hook = None if mutant is None else f"tests.multigpu.mutants:{mutant}"
    plan = dataclasses.replace(PLAN, arm_hook=hook, **changes)
    return evidence.build_record(plan, worlds.get(2).run(qualify_rank, plan)[0])


def _check(record, name: str):
    return next(check for check in record.checks if check.name == name)


def test_the_correct_candidate_passes_with_overflow_skipped_steps(worlds):
    record = qualify(worlds)
    assert record.verdict.status == "PASS", [c for c in record.checks if c.status != "pass"]
    trace = {item.arm: item for item in record.loss_scaling}
    overflowed = [step for step, flag in enumerate(trace[CANDIDATE].overflowed, 1) if flag]
    assert overflowed, "the window holds no overflow-skipped step"
    assert overflowed[0] == 1  # 2**18 overflows the first step
    updates = next(item for item in record.updates if item.arm == CANDIDATE)
    assert sorted({step for step, _ in updates.skipped_steps}) == overflowed
    assert sorted(rank for step, rank in updates.skipped_steps if step == 1) == [0, 1]
    # The scale moved: spent the hysteresis, halved, doubled after the window.
    scales = trace[CANDIDATE].scales[0]
    assert len(set(scales)) >= 2 and max(scales[1:]) >= scales[0] / 2
    for family in ("finite", "update", "overflow-pattern", "own-shard", "step1-exact"):
        assert f"{family}[{CANDIDATE}]" in record.verdict.evidence
    assert _check(record, f"finite[{CANDIDATE}]").numbers["overflow_skipped"] == len(overflowed)
    first = next(item for item in record.step_one if item.arm == CANDIDATE)
    assert first.step == next(s for s in range(1, PLAN.steps + 1) if s not in overflowed)


MUTANT_PLANS = {"skipped_step_counted": {"fp16_loss_scale_window": 2, "steps": 10}}
"""A mutant that needs a skip after the first optimizer step (Adam has no state before it):
a window of 2 lets the scale double back into overflow within 10 steps."""


@pytest.mark.parametrize("mutant", sorted(mutants.FP16_KILLED_BY))
def test_every_fp16_mutant_is_killed(worlds, mutant):
    record = qualify(worlds, mutant, **MUTANT_PLANS.get(mutant, {}))
    first_update = next(item.step for item in record.step_one if item.arm == CANDIDATE)
    trace = next(item for item in record.loss_scaling if item.arm == CANDIDATE)
    assert any(trace.overflowed[first_update - 1 :]) or mutant not in MUTANT_PLANS, (
        "no overflow after the first optimizer step: the mutant had nothing to break"
    )
    expected = f"{mutants.FP16_KILLED_BY[mutant]}[{CANDIDATE}]"
    failing = {check.name: check.detail for check in record.checks if check.status == "fail"}
    assert record.verdict.status == "FAIL", f"{mutant} survived: {record.verdict}"
    assert expected in failing, f"{mutant}: {expected} did not fail; failed: {failing}"
    assert all(CANDIDATE in name for name in failing), failing


def test_the_gather_mutant_is_harmless_without_overflow(worlds):
    """The stale-flag mutant only acts after an overflow-skipped step: in bf16 it PASSes, so
    only an fp16 qualification with skips in its window can catch it."""
    record = qualify(worlds, "gather_skipped_after_overflow", dtype="bf16")
    assert record.verdict.status == "PASS", [c for c in record.checks if c.status != "pass"]
    assert record.loss_scaling == []


def test_the_never_growing_scaler_is_caught_only_by_overflow_pattern(worlds):
    """Its skips follow its own gradients and its first step is the reference's, so only the
    scale rule sees that the scale did not double after the window."""
    record = qualify(worlds, "scaler_never_grows")
    assert [name for name in record.verdict.failed] == [f"overflow-pattern[{CANDIDATE}]"]
    assert "does not follow the rules" in _check(record, f"overflow-pattern[{CANDIDATE}]").detail


def test_a_window_that_ends_on_a_skipped_step_still_measures_the_wire(worlds):
    """A skipped step runs no gather: the probe keeps the last gather's bytes, so probe and
    in-effect judge the wire even when the window's last step overflowed."""
    record = qualify(worlds, **MUTANT_PLANS["skipped_step_counted"])
    trace = next(item for item in record.loss_scaling if item.arm == CANDIDATE)
    assert trace.overflowed[-1], "the window's last step did not overflow"
    assert record.verdict.status == "PASS", [c for c in record.checks if c.status != "pass"]
    for family in ("probe", "in-effect"):
        assert _check(record, f"{family}[{CANDIDATE}]").passed
