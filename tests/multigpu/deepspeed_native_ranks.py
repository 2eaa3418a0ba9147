"""Rank side of the direct DeepSpeed-native tests (tests/multigpu/test_deepspeed_native.py).

:func:`drive` runs in a child process whose ``PYTHONPATH`` starts with a checkout of DeepSpeed
with ``proposal.patch`` (and, per branch, a broken variant) committed; for each branch it starts
a 2-rank world whose ranks train with that branch's own ``deepspeed.initialize`` and return
what :func:`native_steps` observed. The spec the observations are compared with is written out
here, never imported from qwz.

This module imports no DeepSpeed at its top, and neither does the child that drives it: the
ranks are forked from the child ([Note: forked ranks], qwz/qualify/run/launch.py), each after
its branch is checked out, so each imports that branch's DeepSpeed itself.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from tests.deepspeed_checkout import use_variant
from tests.multigpu.models import MICRO_BATCH, batch, build_deepspeed_layout_mlp

EXACT_PARAM_NUMEL = 65536
"""The proposal's rule: parameters of at most this many elements travel exactly."""
STEPS = 3
"""Steps of each direct run."""


# ---------------------------------------------------------------- the spec, written out here
def spec_partition(
    master: torch.Tensor, exact: torch.Tensor, group_size: int, dtype
) -> torch.Tensor:
    """The owner's partition as the proposal leaves it: `master` (fp32, (P,)) zero-padded to
    whole groups with its exact elements zeroed, quantized per group (scale absmax/127 in fp32,
    at least 2**-126; codes round-to-nearest clamped to [-127, 127]), decoded, cast to `dtype`;
    the elements where `exact` is True are the master cast to `dtype`."""
    padded_numel = -(-master.numel() // group_size) * group_size
    values = torch.zeros(padded_numel, dtype=torch.float32)
    values[: master.numel()] = torch.where(exact, 0.0, master.float())
    groups = values.view(-1, group_size)  # (num_groups, group_size)
    absmax = groups.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, (absmax / 127).clamp(min=2.0**-126), 0.0)
    codes = torch.where(scale > 0, groups / torch.where(scale > 0, scale, 1.0), 0.0)
    decoded = (codes.round().clamp(-127, 127) * scale).view(-1)[: master.numel()].to(dtype)
    return torch.where(exact, master.to(dtype), decoded)


def spec_gather_bytes(partition_numel: int, exact_per_rank: list[int], group_size: int) -> int:
    """Bytes one rank contributes to one group's gather (one chunk): a code byte per element
    of the partition padded to whole groups, 4 bytes of fp32 scale per group, and the most
    exact elements any rank holds in bf16, padded to 4 bytes. Stock bf16 sends 2 per element."""
    groups = -(-partition_numel // group_size)
    exact_bytes = -(-2 * max(exact_per_rank) // 4) * 4
    return groups * group_size + 4 * groups + exact_bytes


# ---------------------------------------------------------------- the rank body
def _exact_masks(engine: Any, group: int) -> torch.Tensor:
    """(W, P) bool: elements of each rank's partition that belong to parameters of at most
    EXACT_PARAM_NUMEL elements, found from where the module's parameters point."""
    optimizer = engine.optimizer
    flat = optimizer.bit16_groups_flat[group]
    world_size = len(optimizer.parallel_partitioned_bit16_groups[group])
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    for param in engine.module.parameters():
        offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
        if 0 <= offset < flat.numel() and param.numel() <= EXACT_PARAM_NUMEL:
            mask[offset : offset + param.numel()] = True
    return mask.view(world_size, -1)


def native_steps(checkout: str, stage: int, group_size: int, steps: int = STEPS) -> dict[str, Any]:
    """Train `steps` bf16 steps with the checkout's own DeepSpeed; per step, this rank's
    gather bytes and the spec's, whether its partitions equal the spec's decode and its exact
    elements the master, and the digest of its working copy."""
    import deepspeed
    from deepspeed.utils import logger

    from qwz.integrations.probe import WireProbe

    assert pathlib.Path(deepspeed.__file__).resolve().is_relative_to(checkout), deepspeed.__file__
    logger.setLevel("WARNING")
    model = build_deepspeed_layout_mlp(seed=0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": stage,
            "zero_quantized_weights": True,
            "zero_quantized_weights_group_size": group_size,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    optimizer = engine.optimizer
    rank = dist.get_rank()
    observed: dict[str, list] = {"bytes": [], "spec_bytes": [], "own_is_spec": [], "digest": []}
    observed["own_exact_is_master"] = []
    for step in range(1, steps + 1):
        inputs, targets = batch(0, step, rank, torch.bfloat16)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs).float(), targets))
        with WireProbe() as probe:
            engine.step()
        observed["bytes"].append(probe.bytes["gather"])
        spec_bytes, own_is_spec, exact_is_master = 0, True, True
        for group, master in enumerate(optimizer.single_partition_of_fp32_groups):
            exact = _exact_masks(engine, group)
            partition = optimizer.parallel_partitioned_bit16_groups[group][rank]
            expected = spec_partition(master, exact[rank], group_size, partition.dtype)
            own_is_spec &= torch.equal(partition, expected)
            exact_is_master &= torch.equal(partition[exact[rank]], master[exact[rank]].bfloat16())
            exact_per_rank = [int(row.sum()) for row in exact]
            spec_bytes += spec_gather_bytes(partition.numel(), exact_per_rank, group_size)
        observed["spec_bytes"].append(spec_bytes)
        observed["own_is_spec"].append(own_is_spec)
        observed["own_exact_is_master"].append(exact_is_master)
        flats = b"".join(f.view(torch.uint8).numpy().tobytes() for f in optimizer.bit16_groups_flat)
        observed["digest"].append(hashlib.sha256(flats).hexdigest())
    observed["stock_bytes"] = sum(
        2 * p[rank].numel() for p in optimizer.parallel_partitioned_bit16_groups
    )
    observed["reported_group_size"] = engine.zero_quantized_weights_group_size()
    return observed


def drive(checkout: str, variants: dict[str, list[list[int]]]) -> dict[str, dict[str, list]]:
    """In the child process, for each variant: its branch checked out, then every (stage,
    group_size) run on one 2-rank world started after the checkout, so its ranks import that
    branch's DeepSpeed. The ranks are forked from this child where [Note: forked ranks]
    allows (with ``torch._dynamo`` imported once here), so this child must not have imported
    ``deepspeed``: its ranks would start from the first branch's modules."""
    from qwz.qualify.run.launch import LocalWorld

    assert "deepspeed" not in sys.modules, "the ranks must import each branch's own DeepSpeed"
    results = {}
    for variant, runs in variants.items():
        use_variant(pathlib.Path(checkout), variant)
        with LocalWorld(2, timeout_s=300, preload=("torch._dynamo",)) as world:
            results[variant] = {
                f"{s}-{g}": world.run(native_steps, checkout, s, g) for s, g in runs
            }
    return results
