"""The launcher's CUDA check of the fused kernels ([Note: fused kernels checked before a
run], qwz/qualify/request/kernel_check.py): asked in a child process, reported, never an error and
never a change of the plan (each rank's own GPU decides, and the record names it)."""

from __future__ import annotations

import pytest
import torch

from qwz.qualify import cli
from qwz.qualify.base.plan import RunPlan
from qwz.qualify.request import kernel_check
from qwz.qualify.run import launch
from qwz.qualify.run.workloads import get_workload

PLAN = RunPlan(workload=get_workload("mlp"), dtype="bf16")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_child_answers_why_and_the_launcher_holds_no_cuda_context():
    """On a machine without CUDA the self-test on cuda:0 really fails, in the child; on the
    CPU it passes (the native kernels). The launcher itself never touches CUDA."""
    reason = kernel_check.self_test_in_child("cuda:0", torch.bfloat16)
    assert reason is not None and reason.startswith("torch.compile on cuda:0: "), reason
    assert kernel_check.self_test_in_child("cpu", torch.bfloat16) is None
    assert not torch.cuda.is_initialized()


def test_a_failing_cuda_self_test_is_reported_and_the_plan_keeps_fused(monkeypatch, capsys):
    asked = []

    def self_test_in_child(device, dtype):
        asked.append((device, dtype))
        return "torch.compile on cuda:0: forced failure"

    monkeypatch.setattr(kernel_check, "ranks_use_cuda", lambda world_size: True)
    monkeypatch.setattr(kernel_check, "self_test_in_child", self_test_in_child)
    reason = kernel_check.cuda_failure(PLAN, 2, under_torchrun=False)
    assert reason == "torch.compile on cuda:0: forced failure"
    assert asked == [("cuda:0", torch.bfloat16)]
    message = capsys.readouterr().err
    assert "fail their self-test on cuda:0 (torch.compile on cuda:0: forced failure)" in message
    assert "the record names the fallback" in message
    eager = RunPlan(workload=get_workload("mlp"), kernels="eager")
    assert kernel_check.cuda_failure(eager, 2, under_torchrun=False) is None
    assert kernel_check.cuda_failure(PLAN, 2, under_torchrun=True) is None  # ranks check
    assert len(asked) == 1


def test_cpu_ranks_ask_no_cuda_check(monkeypatch):
    def must_not_ask(device, dtype):
        raise AssertionError("asked for a CUDA check with CPU ranks")

    monkeypatch.setattr(kernel_check, "ranks_use_cuda", lambda world_size: False)
    monkeypatch.setattr(kernel_check, "self_test_in_child", must_not_ask)
    assert kernel_check.cuda_failure(PLAN, 2, under_torchrun=False) is None


def test_the_run_command_checks_cuda_before_it_launches(tmp_path, monkeypatch, capsys):
    order = []
    monkeypatch.setattr(kernel_check, "ranks_use_cuda", lambda world_size: True)
    monkeypatch.setattr(
        kernel_check, "self_test_in_child", lambda device, dtype: order.append("check") or "no"
    )

    def launched(function, world_size, plan, **kwargs):
        order.append(("launch", plan.kernels))
        raise launch.Interrupted(2)

    monkeypatch.setattr(launch, "launch", launched)
    argv = ["run", "--out", str(tmp_path / "out"), "--workload", "mlp"]
    assert cli.main(argv) == 130
    assert order == ["check", ("launch", "fused")]
    assert "fail their self-test on cuda:0 (no)" in capsys.readouterr().err
