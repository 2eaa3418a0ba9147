"""The DeepSpeed drop-in on a data-parallel group of one rank gathers exactly, as stock
DeepSpeed does and as qwz's own engine does ([Note: one rank gathers exactly]): no int8
error where no byte would be saved, and the optimizer reports no group size."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from . import deepspeed_ranks as ranks

pytestmark = pytest.mark.multigpu


def one_rank_training(stage: int, steps: int = 3) -> dict[str, Any]:
    """On one rank: train the drop-in (quantization requested) and stock DeepSpeed side by
    side; compare their weights and the drop-in's working copy with its masters."""
    import qwz

    quantized = ranks._build(ranks.ds_config(stage=stage, group_size=64), seed=0)
    stock = ranks._build(ranks.ds_config(stage=stage, quantized=False), seed=0, plain=True)
    for step in range(steps):
        for engine in (quantized, stock):
            ranks._forward_backward(engine, seed=0, step=step)
            engine.step()
    shards = quantized.optimizer.own_shards()
    return {
        "group_size": quantized.optimizer.quantization_group_size,
        "shard_group_sizes": [shard.group_size for shard in shards],
        "working_is_master_cast": all(
            torch.equal(shard.working, shard.master.detach().to(shard.working.dtype))
            for shard in shards
        ),
        "same_as_stock": qwz.param_hash(quantized.module) == qwz.param_hash(stock.module),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_gathers_exactly_through_the_drop_in(worlds, stage):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    [result] = worlds.get(1).run(one_rank_training, stage)
    assert result["group_size"] is None
    assert result["shard_group_sizes"] == [None] * len(result["shard_group_sizes"])
    assert result["working_is_master_cast"]
    assert result["same_as_stock"]
