"""The optimizer's shard alignment ([Note: padding rule], qwz/layout.py), at world size 1:
engines of different group sizes given one alignment lay their buffers out alike, and a bad
alignment is refused by the optimizer and, whatever the world size, by the engine."""

from __future__ import annotations

import pytest
import torch

import qwz

PRESERVE_NUMEL = 64
"""The 40x30 weight is quantized; the bias (40 elements) travels exactly."""
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 2,
        "zero_quantized_weights": True,
        "zero_quantized_weights_group_size": 64,
    },
}


def build_optimizer(group_size: int, quantize: bool, alignment: int | None) -> qwz.ZeroOptimizer:
    model = torch.nn.Linear(30, 40)
    return qwz.ZeroOptimizer(
        list(model.named_parameters()),
        stage=2,
        optimizer=qwz.OptimizerSpec("adamw", {"lr": 1e-3}),
        gather=qwz.GatherPolicy(
            quantize=quantize,
            group_size=group_size,
            preserve_numel=PRESERVE_NUMEL,
            bucket_size=10**6,
            shard_alignment=alignment,
        ),
        reduce=qwz.ReducePolicy(bucket_size=10**6),
    )


def layouts(optimizer: qwz.ZeroOptimizer) -> list[tuple]:
    """Per region: its name, slots, shard range of rank 0 and padded length."""
    return [
        (r.name, r.layout.slots, r.layout.shard_range(0), r.layout.padded_numel)
        for r in optimizer.regions
    ]


def test_one_alignment_gives_the_reference_and_every_candidate_one_layout():
    arms = [(64, False), (64, True), (8192, True)]
    aligned = [layouts(build_optimizer(size, quantize, 8192)) for size, quantize in arms]
    assert aligned[1:] == aligned[:1] * 2
    assert aligned[0][-1][3] == 8192  # 1200 weight elements padded to one 8192-element shard
    # Without it each candidate pads to its own group size: the layouts differ.
    own = [layouts(build_optimizer(size, True, None)) for size in (64, 8192)]
    assert own[0][-1][3] == 1216 and own[1][-1][3] == 8192


def test_default_alignment_is_the_group_size():
    optimizer = build_optimizer(64, True, None)
    assert optimizer.shard_alignment == 64
    assert optimizer.regions[-1].layout.shard_alignment == 64
    assert optimizer.regions[0].layout.shard_alignment == 1  # the exact region: element by element


def test_optimizer_refuses_an_alignment_that_splits_groups():
    with pytest.raises(ValueError, match=r"shard_alignment: 96 is invalid: must be a positive "
                       r"multiple of the quantization group size 64"):  # fmt: skip
        build_optimizer(64, True, 96)


def test_engine_refuses_it_at_one_rank_too():
    """One rank gathers exactly ([Note: one rank gathers exactly], engine.py), but an
    alignment that more ranks would refuse is refused here as well."""
    with pytest.raises(ValueError, match=r"shard_alignment: 96 is invalid"):
        qwz.initialize(torch.nn.Linear(30, 40), config=CONFIG, shard_alignment=96)
    # 90,000 weight elements: above the default preserve_numel, so a quantized region.
    engine = qwz.initialize(torch.nn.Linear(300, 300), config=CONFIG, shard_alignment=8192)
    assert engine.optimizer.regions[-1].layout.shard_alignment == 8192
