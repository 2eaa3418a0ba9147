"""A data-parallel group of one rank takes the exact path ([Note: one rank gathers exactly],
qwz/engine.py): no int8 error where no byte would be saved, and the engine says so."""

from __future__ import annotations

import pytest
import torch

import qwz


def engine(quantized: bool, dtype: str, stage: int) -> qwz.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))
    config = {
        "zero_optimization": {
            "stage": stage,
            "zero_quantized_weights": quantized,
            "zero_quantized_weights_preserve_numel": 100,  # the 40x30 weight is "large"
        },
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    }
    return qwz.initialize(model, config=config)


def train(run: qwz.Engine, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs = torch.randn(8, 40, generator=generator)
        dtype = run.module[0].weight.dtype
        run.backward(run(inputs.to(dtype)).float().square().mean())
        assert run.step()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_gathers_exactly_and_reports_no_group_size(stage, dtype):
    quantized, reference = engine(True, dtype, stage), engine(False, dtype, stage)
    assert quantized.optimizer.quantization_group_size is None
    train(quantized)
    train(reference)
    assert qwz.param_hash(quantized.module) == qwz.param_hash(reference.module)
    for shard in quantized.optimizer.own_shards():
        assert shard.group_size is None and shard.scales is None
        assert torch.equal(shard.working, shard.master.detach().to(shard.working.dtype))
