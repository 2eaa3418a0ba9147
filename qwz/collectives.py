"""Stateless gathers and reductions: the bounded (optionally quantized) weight gather and the
bucketed gradient reductions.

Nothing here reads a config: every function receives plain sizes, a process
group and the tensors it works on, and returns a NamedTuple of what it moved.
With ``world_size == 1`` the same code runs with the collectives skipped.

[Note: replica consistency]
After every step each rank's working copy must be bit-identical to every
other rank's, while each fp32 master shard stays exact. The gather guarantees
it by construction: the owner does not keep its own freshly stepped shard.
It packs its shard into the staging buffer (int8 codes + fp32 scales, or the
working dtype when not quantizing), the collective fills every rank's
staging with the same bytes, and then *every* rank -- the owner included --
decodes the whole staging buffer with the same kernel and writes the result
into its working buffer. Equal bytes in, the same deterministic decode, equal
values out. The master shard is never overwritten with the decoded values, so
quantization error does not accumulate in the optimizer's state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from qwz.layout import SCALE_BYTES, ChunkPlan
from qwz.quant import EAGER_KERNELS, QuantKernels


class GatherStats(NamedTuple):
    """What one gather moved, as seen by this rank."""

    collectives: int
    """Number of collective calls issued (0 with world size 1)."""
    bytes_sent: int
    """Bytes this rank contributed to the collectives (its input slots)."""
    peak_staging_bytes: int
    """Largest staging buffer allocated for one chunk, all ranks' slots together."""


class ReduceStats(NamedTuple):
    collectives: int
    bytes_sent: int


def _all_gather_into(output: torch.Tensor, slot: torch.Tensor, group: dist.ProcessGroup | None):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, slot, group=group)


def _reduce_scatter_into(
    output: torch.Tensor, stacked: torch.Tensor, group: dist.ProcessGroup | None
):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, stacked, group=group)


@torch.no_grad()
def gather_shards(
    local_shard: torch.Tensor,
    full: torch.Tensor,
    *,
    plan: ChunkPlan,
    rank: int,
    quantize: bool,
    group: dist.ProcessGroup | None = None,
    kernels: QuantKernels = EAGER_KERNELS,
) -> GatherStats:
    """Write every rank's `local_shard` into `full`, chunk by chunk.

    local_shard: (shard_numel,), any float dtype (the fp32 master shard).
    full: (world_size * shard_numel,), the working buffer, written in place.
    With `quantize`, each chunk travels as int8 codes + fp32 scales in groups of
    ``plan.unit_numel``; otherwise in `full`'s dtype. See [Note: staging bound]
    in layout.py and [Note: replica consistency] above.
    """
    world_size, shard_numel = plan.world_size, plan.shard_numel
    if local_shard.numel() != shard_numel or full.numel() != world_size * shard_numel:
        raise ValueError(
            f"gather_shards: local_shard has {local_shard.numel()} and full has {full.numel()} "
            f"elements; the plan needs {shard_numel} and {world_size * shard_numel}"
        )
    rank_views = full.view(world_size, shard_numel)
    group_size = plan.unit_numel
    collectives = bytes_sent = peak_staging = 0
    for start, end in plan.chunks():
        chunk_numel = end - start
        if quantize:
            row_bytes = chunk_numel + (chunk_numel // group_size) * SCALE_BYTES
            staging = torch.empty(world_size, row_bytes, dtype=torch.uint8, device=full.device)
            kernels.pack(local_shard[start:end], staging[rank], group_size)
        else:
            staging = torch.empty(world_size, chunk_numel, dtype=full.dtype, device=full.device)
            staging[rank].copy_(local_shard[start:end])
        peak_staging = max(peak_staging, staging.numel() * staging.element_size())
        if world_size > 1:
            _all_gather_into(staging.view(-1), staging[rank], group)
            collectives += 1
            bytes_sent += staging[rank].numel() * staging.element_size()
        if quantize:
            kernels.unpack(staging, rank_views[:, start:end], group_size)
        else:
            rank_views[:, start:end].copy_(staging)
    return GatherStats(collectives, bytes_sent, peak_staging)


@torch.no_grad()
def all_reduce_in_buckets(
    flat: torch.Tensor,
    *,
    bucket_numel: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
) -> ReduceStats:
    """Sum `flat` across ranks in place, `bucket_numel` elements per collective."""
    if world_size == 1:
        return ReduceStats(0, 0)
    collectives = bytes_sent = 0
    for start in range(0, flat.numel(), bucket_numel):
        bucket = flat[start : start + bucket_numel]
        dist.all_reduce(bucket, group=group)
        collectives += 1
        bytes_sent += bucket.numel() * bucket.element_size()
    return ReduceStats(collectives, bytes_sent)


@torch.no_grad()
def reduce_scatter_in_buckets(
    flat: torch.Tensor,
    shard_out: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    bucket_numel: int,
    group: dist.ProcessGroup | None = None,
) -> ReduceStats:
    """Add the cross-rank sum of `rank`'s shard of `flat` (world_size * shard_numel,) into
    `shard_out` (shard_numel,), `bucket_numel` elements (all ranks together) per collective."""
    shard_numel = shard_out.numel()
    rank_views = flat.view(world_size, shard_numel)
    if world_size == 1:
        shard_out.add_(rank_views[0])
        return ReduceStats(0, 0)
    per_rank = max(1, bucket_numel // world_size)
    collectives = bytes_sent = 0
    for start in range(0, shard_numel, per_rank):
        end = min(start + per_rank, shard_numel)
        stacked = rank_views[:, start:end].to(shard_out.dtype).contiguous()
        reduced = torch.empty(end - start, dtype=shard_out.dtype, device=shard_out.device)
        _reduce_scatter_into(reduced, stacked.view(-1), group)
        shard_out[start:end].add_(reduced)
        collectives += 1
        bytes_sent += stacked.numel() * stacked.element_size()
    return ReduceStats(collectives, bytes_sent)


def all_reduce_sum(value: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None):
    """Sum a small tensor across ranks in place (a no-op with world size 1)."""
    if world_size > 1:
        dist.all_reduce(value, group=group)
    return value
