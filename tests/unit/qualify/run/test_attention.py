"""The Qwen3 workloads' attention implementation ([Note: attention implementation],
qwz/qualify/run/workloads.py): eager by default, as every record before the setting; SDPA
on request, recorded in the workload's params, computing the same loss."""

from __future__ import annotations

import pytest
import torch

from qwz.qualify import cli
from qwz.qualify.run.workloads import get_workload
from tests.extras import NEEDS_TRANSFORMERS
from tests.unit.run_requests import plan_of

pytestmark = NEEDS_TRANSFORMERS


def test_eager_is_the_default_and_leaves_the_workload_s_params_as_they_were():
    eager = get_workload("qwen3-tiny")
    assert "attention" not in eager.params and eager == get_workload("qwen3-tiny", "eager")
    assert eager.build_model(0).config._attn_implementation == "eager"
    planned = plan_of(cli.build_parser().parse_args(["run", "--out", "x"]))
    assert planned.attention == "eager" and planned.workload == eager


def test_sdpa_is_recorded_and_computes_the_eager_loss():
    """fp32 on the CPU: the two implementations agree to float32 rounding, and a backward
    through SDPA gives every parameter a finite gradient."""
    sdpa = get_workload("qwen3-tiny", attention="sdpa")
    assert sdpa.params["attention"] == "sdpa"
    planned = plan_of(cli.build_parser().parse_args(["run", "--out", "x", "--attention", "sdpa"]))
    assert planned.workload == sdpa
    batch = sdpa.batch(seed=0, step=1, rank=0)
    losses = {}
    for name in ("eager", "sdpa"):
        workload = get_workload("qwen3-tiny", attention=name)
        model = workload.build_model(0, dtype=torch.float32)
        assert model.config._attn_implementation == name
        loss = workload.loss(model, batch)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[name] = float(loss)
    assert losses["sdpa"] == pytest.approx(losses["eager"], rel=1e-5)


def test_the_mlp_workloads_have_no_attention_to_choose():
    assert get_workload("mlp", attention="sdpa") == get_workload("mlp")
