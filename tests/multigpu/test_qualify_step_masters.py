"""The masters after every step (``step_masters``, [Note: short digests] in
qwz/qualify/run/observers/digest.py) and a run of the reference arm alone (``arm_set``
"reference", what ``review`` runs at a pull request's base), on two real ranks."""

from __future__ import annotations

import dataclasses
import re

import pytest

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload

pytestmark = pytest.mark.multigpu

PLAN = RunPlan(
    workload=get_workload("mlp"),
    steps=4,
    eval_every=2,
    calibration=False,
    blocks=1,
    block_steps=1,
    warmup_steps=0,
    kernels="eager",
)


def qualify(worlds, plan: RunPlan):
    observations = worlds.get(2).run(qualify_rank, plan)[0]
    return evidence.build_record(plan, observations)


def test_every_arm_records_its_masters_after_every_step(worlds):
    record = qualify(worlds, PLAN)
    by_arm = {item.arm: item.digests for item in record.step_masters}
    assert set(by_arm) == {"reference", "candidate-g64"}
    names = [name for name, _ in get_workload("mlp").build_model(0).named_parameters()]
    for arm, digests in by_arm.items():
        assert len(digests) == PLAN.steps, arm
        assert all(list(step) == names for step in digests), arm
        values = [value for step in digests for value in step.values()]
        assert all(re.fullmatch("[0-9a-f]{8}", value) for value in values), arm
        assert digests[0] != digests[1], f"{arm}: the masters did not move"
    step_one = {item.arm: item.digests for item in record.step_one}
    for arm, digests in by_arm.items():  # the short digest is the full one's low 32 bits
        assert digests[0] == {name: value[-8:] for name, value in step_one[arm].items()}
    # Same start, same first gradient: step 1's masters agree; the gathers differ after.
    assert by_arm["reference"][0] == by_arm["candidate-g64"][0]
    assert by_arm["reference"][-1] != by_arm["candidate-g64"][-1]


def test_the_reference_alone_trains_and_times_one_arm(worlds):
    plan = dataclasses.replace(PLAN, arm_set="reference")
    alone = qualify(worlds, plan)
    full = qualify(worlds, PLAN)
    assert [arm.name for arm in alone.arms] == ["reference"]
    assert {family.split("[")[0] for family in (c.name for c in alone.checks)} >= {
        "finite",
        "update",
        "replicas",
        "learning",
    }
    # Every check of an arm is the reference's (conformance, of the run, has no arm).
    assert all(check.name.endswith("[reference]") for check in alone.checks if "[" in check.name)
    # The same reference, bit for bit, whatever else the run trains.
    assert alone.step_masters[0].digests == full.step_masters[0].digests
    assert alone.trajectories[0].losses == full.trajectories[0].losses
    # Timed against itself: an A/A block of its step times, for context.
    [performance] = alone.performance
    assert performance.arm == "reference" and len(performance.blocks) == 1
    assert performance.blocks[0].reference_times_s and performance.blocks[0].candidate_times_s
    assert alone.learning.calibration_arm is None and alone.learning.calibration_group_size is None
