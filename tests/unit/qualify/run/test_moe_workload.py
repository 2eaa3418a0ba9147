"""The ``moe-tiny`` workload ([Note: MoE workload], qwz/qualify/run/moe.py) without ranks:
what it refuses before any rank starts, its shape, its replica keys and its batches."""

from __future__ import annotations

import pytest
import torch

from qwz.qualify import cli
from qwz.qualify.run import launch, moe, workloads
from qwz.qualify.run.workloads import get_workload

pytest.importorskip("deepspeed", reason="moe-tiny is DeepSpeed's MoE layer")

WORKLOAD = get_workload("moe-tiny")


def _must_not_launch(*args, **kwargs):
    raise AssertionError("launched although the request was refused")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--subject", "qwz"],
            "--workload moe-tiny: --subject qwz cannot run it: qwz's engine gathers every "
            "parameter over one process group and has no expert parallelism",
        ),
        (
            ["--subject", "deepspeed", "--world-size", "3"],
            "--world-size 3: moe-tiny: world size 3 is not a multiple of ep_size 2",
        ),
    ],
)
def test_run_refuses_before_any_rank_starts_with_exit_2(
    tmp_path, monkeypatch, capsys, argv, message
):
    monkeypatch.setattr(launch, "launch", _must_not_launch)
    code = cli.main(["run", "--out", str(tmp_path / "out"), "--workload", "moe-tiny", *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_only_the_layouts_deepspeed_can_place_are_accepted():
    assert WORKLOAD.refusals("deepspeed", 2) == []
    assert WORKLOAD.refusals("deepspeed-native", 4) == []
    assert WORKLOAD.refusals("deepspeed", 6) == []
    assert WORKLOAD.refusals("deepspeed", 1)  # one rank cannot hold an ep_size-2 group
    with pytest.raises(ValueError, match="num_experts 3 must be a positive multiple of ep_size 2"):
        moe.check_sizes(3, 2, None)


def test_the_model_has_quantized_experts_and_keys_them_by_global_index():
    with torch.device("meta"):
        model = WORKLOAD.build_model(0)
    params = dict(model.named_parameters())
    experts = [name for name in params if ".deepspeed_experts." in name]
    assert len(experts) == 4  # two local experts (4 / ep_size 2), weight and bias each
    assert all(params[name].numel() > 65_536 for name in experts if name.endswith("weight"))
    keys = WORKLOAD.replica_keys(model)
    # One process: expert-parallel rank 0 holds experts 0 and 1.
    assert {keys[name] for name in experts} == {"expert0", "expert1"}
    assert {keys[name] for name in params if name not in experts} == {"dense"}


def test_batches_depend_on_seed_step_and_rank_only_and_follow_a_teacher():
    first = WORKLOAD.batch(seed=3, step=5, rank=1)
    again = WORKLOAD.batch(seed=3, step=5, rank=1)
    other = WORKLOAD.batch(seed=3, step=5, rank=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    inputs, targets = first
    assert inputs.shape == (32, 263) and targets.shape == (32, 3)
    # The targets are the seeded linear teacher of the inputs plus TEACHER_NOISE: learnable.
    residual = targets - inputs @ workloads._teacher(263, 3, 3)
    assert residual.std() < 2 * workloads.TEACHER_NOISE < targets.std()
