"""The harness on the group's device, and its memory measured around the train step.

A CPU-only machine has one real device, so the group's device is faked as ``meta``:
a tensor that reaches a collective on the CPU while the group lives elsewhere is exactly
what fails on a plain NCCL group ([Note: collectives on the group's device],
qwz/devices.py). The collective spy checks placement and stops there (a meta tensor
holds no values to reduce)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qwz import devices
from qwz.qualify.base.plan import RunPlan
from qwz.qualify.run import arm_run, subjects
from qwz.qualify.run.observers import own_shard, step_memory
from qwz.qualify.run.workloads import get_workload
from tests.extras import NEEDS_TRANSFORMERS

FAKE_GROUP_DEVICE = torch.device("meta")


class ReachedCollective(Exception):
    """The spy saw a tensor on the group's device: placement is right."""


@pytest.fixture
def meta_group(monkeypatch):
    """An initialised one-rank group on the meta device; every all_reduce is checked."""
    seen: list[torch.device] = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        assert tensor.device == FAKE_GROUP_DEVICE, (
            f"a collective got a tensor on {tensor.device}; the group's device is "
            f"{FAKE_GROUP_DEVICE}"
        )
        raise ReachedCollective

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(devices, "group_device", lambda group=None: FAKE_GROUP_DEVICE)
    return seen


def test_mean_over_ranks_hands_the_collective_a_tensor_on_the_group_s_device(meta_group):
    with pytest.raises(ReachedCollective):
        arm_run.mean_over_ranks(torch.tensor(1.5))
    assert meta_group == [FAKE_GROUP_DEVICE]


def test_the_held_out_loss_is_reduced_on_the_group_s_device(meta_group):
    """It used to be moved to the CPU first: every arm failed at step 0 on NCCL."""
    plan = RunPlan(workload=get_workload("mlp"), held_out_batches=2)
    engine = subjects.ArmEngine()
    engine.module = plan.workload.build_model(0)
    with pytest.raises(ReachedCollective):
        arm_run.held_out_loss(plan, engine, rank=0, step=0)
    assert meta_group == [FAKE_GROUP_DEVICE]


@pytest.mark.parametrize("name", ["mlp", pytest.param("qwen3-tiny", marks=NEEDS_TRANSFORMERS)])
def test_arms_are_built_on_the_group_s_device_in_the_working_dtype(monkeypatch, name):
    built: list[torch.nn.Module] = []

    def make_arm(subject, model, config, **kwargs):
        built.append(model)
        return subjects.ArmEngine()

    monkeypatch.setattr(devices, "group_device", lambda group=None: FAKE_GROUP_DEVICE)
    monkeypatch.setattr(arm_run, "make_arm", make_arm)
    plan = RunPlan(workload=get_workload(name), dtype="bf16")
    arm_run.build(plan, plan.arms[0])
    for model in built:
        assert {p.device for p in model.parameters()} == {FAKE_GROUP_DEVICE}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


class Meter:
    """Fake memory counters: `peak` grows with what is charged, reset to 0."""

    STEP_BYTES = 1_000
    CHECK_BYTES = 1_000_000

    def __init__(self) -> None:
        self.peak = 0

    def reset(self) -> None:
        self.peak = 0

    def read(self) -> dict:
        return {"kind": "fake", "peak_allocated_bytes": self.peak, "peak_reserved_bytes": None}


def test_peak_memory_is_the_train_step_s_not_the_checks(monkeypatch):
    """The own-shard check (and the held-out loss) allocate outside the train step; an
    arm's memory is its largest step's."""
    meter = Meter()
    monkeypatch.setattr(step_memory, "reset_peak_memory", meter.reset)
    monkeypatch.setattr(step_memory, "peak_memory", meter.read)
    train_step = subjects.QwzArm.train_step
    check_own_shards = own_shard.check_own_shards

    def charged_step(self, loss):
        meter.peak += Meter.STEP_BYTES
        return train_step(self, loss)

    def charged_check(*args, **kwargs):
        meter.peak += Meter.CHECK_BYTES
        return check_own_shards(*args, **kwargs)

    monkeypatch.setattr(subjects.QwzArm, "train_step", charged_step)
    monkeypatch.setattr(own_shard, "check_own_shards", charged_check)
    plan = RunPlan(workload=get_workload("mlp"), dtype="fp32", steps=3, blocks=0, calibration=False)
    obs, _ = arm_run.train_arm(plan, plan.arms[0], 0, None, None, arm_run.Progress(False))
    assert obs.failure is None and obs.steps_completed == 3
    assert obs.memory["peak_allocated_bytes"] == Meter.STEP_BYTES
