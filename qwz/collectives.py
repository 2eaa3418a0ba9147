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

[Note: gather pipeline]
:func:`gather` runs one collective per chunk (quantized groups and exact elements in one
row, [Note: wire row] in quant.py) through staging buffers allocated once
(:class:`Staging`) and, with two buffers, overlaps them::

    pack k  ->  launch k (async)  ->  wait k-1  ->  decode k-1  ->  pack k+1 ...

so chunk k's collective is in flight while chunk k - 1 is decoded and chunk k + 1 packed.
Buffer ``k % 2`` is packed again only after chunk k - 2 was decoded from it, so nothing is
overwritten while it is still read. Packing reads the fp32 master straight into the row;
decoding writes straight into the destination (strided views allowed): no per-chunk
temporary the size of a chunk. A check the caller passes (``before_first_write``) runs once,
just before the first decode, while the first collectives are in flight ([Note: host reads
in a step], optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qwz.kernels import EAGER_KERNELS, KernelChoice, QuantKernels
from qwz.layout import GatherPlan
from qwz.quant import (
    WireRow,
    quantize_groups,
    row_codes,
    row_scales,
    row_values,
)


class GatherStats(NamedTuple):
    """What one gather moved, as seen by this rank."""

    collectives: int
    """Number of collective calls issued (0 with world size 1)."""
    bytes_sent: int
    """Bytes this rank contributed to the collectives (its input slots)."""
    peak_staging_bytes: int
    """Staging bytes in use during the gather, all buffers and all ranks' rows together."""


class ReduceStats(NamedTuple):
    collectives: int
    bytes_sent: int


def _all_gather_into(
    output: torch.Tensor,
    slot: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, slot, group=group, async_op=async_op)


def _reduce_scatter_into(
    output: torch.Tensor, stacked: torch.Tensor, group: dist.ProcessGroup | None
):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, stacked, group=group)


class Staging:
    """Staging buffers allocated once and reused by every gather that shares them; see
    [Note: staging bound] (layout.py) and [Note: gather pipeline]."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor] = []

    def reserve(self, plan: GatherPlan) -> None:
        """Make sure the buffers can serve `plan` (allocates only when they cannot)."""
        while len(self.buffers) < plan.num_buffers:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        for index in range(plan.num_buffers):
            if self.buffers[index].numel() < plan.buffer_bytes:
                self.buffers[index] = torch.empty(
                    plan.buffer_bytes, dtype=torch.uint8, device=self.device
                )

    def rows(self, index: int, world_size: int, row: WireRow) -> torch.Tensor:
        """(world_size, row_bytes) uint8 view of buffer `index` for one chunk."""
        return self.buffers[index][: world_size * row.row_bytes].view(world_size, -1)


class MaskedGroups(NamedTuple):
    """Groups of one chunk of this rank's quantized stream that hold both quantized and
    exact elements (exact runs, [Note: small parameters travel exactly], layout.py): they
    are re-encoded with the exact elements zeroed, so a small parameter's values never
    widen its neighbours' scales."""

    group_index: torch.Tensor
    """int64 (n,): the groups, counted from the chunk's first group."""
    element_index: torch.Tensor
    """int64 (n, G): their elements in the source (clamped into it)."""
    keep: torch.Tensor
    """bool (n, G): which of them are quantized (not exact, not padding)."""


def _pack(
    chunk: Any,
    rows: torch.Tensor,
    rank: int,
    source: torch.Tensor,
    exact_source: torch.Tensor | None,
    kernels: QuantKernels,
    masked: MaskedGroups | None,
    dtype: torch.dtype,
) -> None:
    """Write this rank's row of `chunk`: codes and scales straight from the fp32 source,
    then the raw and exact elements cast to the working `dtype`."""
    row = chunk.row
    own = rows[rank : rank + 1]
    if row.num_groups:
        scales, codes = row_scales(own, row)[0], row_codes(own, row)[0]
        kernels.encode(source[chunk.start : chunk.end], scales, codes)
        if masked is not None:
            values = torch.where(masked.keep, source[masked.element_index], 0.0)
            masked_codes, masked_scales = quantize_groups(values)
            scales.index_copy_(0, masked.group_index, masked_scales)
            codes.view(row.num_groups, -1).index_copy_(0, masked.group_index, masked_codes)
    if not (row.raw_numel or row.exact_numel):
        return
    values = row_values(own, row, dtype)[0]
    if row.raw_numel:
        values[: row.raw_numel].copy_(source[chunk.start : chunk.end])
    for piece in chunk.pieces:
        if piece.owner == rank:
            at = row.raw_numel + piece.row_offset
            values[at : at + piece.numel].copy_(
                exact_source[piece.source_offset : piece.source_offset + piece.numel]
            )


def _decode(
    chunk: Any,
    rows: torch.Tensor,
    dest: torch.Tensor,
    exact_dest: torch.Tensor | None,
    kernels: QuantKernels,
) -> None:
    """Decode every rank's row of `chunk` into `dest`, then its exact pieces."""
    row = chunk.row
    if row.num_groups:
        kernels.decode(
            row_scales(rows, row), row_codes(rows, row), dest[:, chunk.start : chunk.end]
        )
    if not (row.raw_numel or chunk.pieces):
        return
    values = row_values(rows, row, dest.dtype)
    if row.raw_numel:
        dest[:, chunk.start : chunk.end].copy_(values[:, : row.raw_numel])
    for piece in chunk.pieces:
        at = row.raw_numel + piece.row_offset
        exact_dest[piece.owner, piece.dest_offset : piece.dest_offset + piece.numel].copy_(
            values[piece.owner, at : at + piece.numel]
        )


@torch.no_grad()
def gather(
    plan: GatherPlan,
    source: torch.Tensor,
    dest: torch.Tensor,
    *,
    rank: int,
    staging: Staging,
    exact_source: torch.Tensor | None = None,
    exact_dest: torch.Tensor | None = None,
    masked: Sequence[MaskedGroups | None] | None = None,
    group: dist.ProcessGroup | None = None,
    kernels: QuantKernels = EAGER_KERNELS,
    before_first_write: Callable[[], None] | None = None,
) -> GatherStats:
    """Write every rank's `source` into every rank's `dest`, chunk by chunk, one collective
    per chunk, pipelined; see [Note: gather pipeline] and [Note: replica consistency].

    source: (>= plan.source_numel,) this rank's main stream (the fp32 master shard).
    dest: (W, >= plan.source_numel) a view of the working buffer, one row per rank.
    exact_source / exact_dest: where this rank's exact elements are read and the (W, n) view
    their pieces land in: an exact region's buffers, or by default `source` and `dest` (exact
    runs; [Note: small parameters travel exactly], layout.py). masked: per chunk, see
    :class:`MaskedGroups`. before_first_write: called once before the first decode writes
    `dest` (after the first chunks are packed and their collectives launched); what it
    raises ends the gather with `dest` untouched, once the launched collectives are done
    (every rank must raise there together: their collectives are matched).
    """
    world_size = plan.world_size
    exact_source = source if exact_source is None else exact_source
    exact_dest = dest if exact_dest is None else exact_dest
    staging.reserve(plan)
    pending: list[tuple[Any, Any, torch.Tensor]] = []  # launched, not yet decoded
    check = before_first_write

    def finish_oldest() -> None:
        nonlocal check
        if check is not None:
            _open_gate(check, pending)
            check = None
        _finish(*pending.pop(0), dest, exact_dest, kernels)

    for index, chunk in enumerate(plan.chunks):
        rows = staging.rows(index % plan.num_buffers, world_size, chunk.row)
        if plan.num_buffers == 1 and pending:
            finish_oldest()
        chunk_masked = masked[index] if masked else None
        _pack(chunk, rows, rank, source, exact_source, kernels, chunk_masked, dest.dtype)
        work = None
        if world_size > 1:
            work = _all_gather_into(rows.view(-1), rows[rank], group, async_op=True)
        pending.append((work, chunk, rows))
        if len(pending) > 1:
            finish_oldest()
    while pending:
        finish_oldest()
    if check is not None:  # a plan without chunks writes nothing, but the check still runs
        check()
    collectives = len(plan.chunks) if world_size > 1 else 0
    return GatherStats(collectives, plan.wire_bytes(), plan.staging_bytes)


def _open_gate(check: Callable[[], None], pending: list[tuple[Any, Any, torch.Tensor]]) -> None:
    """Run `check`; if it raises, wait for the launched collectives first, so none is left
    writing a staging buffer after the gather has ended."""
    try:
        check()
    except BaseException:
        for work, _, _ in pending:
            if work is not None:
                work.wait()
        raise


def _finish(work, chunk, rows, dest, exact_dest, kernels) -> None:
    if work is not None:
        work.wait()
    _decode(chunk, rows, dest, exact_dest, kernels)


@torch.no_grad()
def all_reduce_in_buckets(
    flat: torch.Tensor,
    *,
    bucket_numel: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    reduce_dtype: torch.dtype | None = None,
    divide_first: bool = False,
) -> ReduceStats:
    """Sum `flat` across ranks in place, `bucket_numel` elements per collective, each
    collective in `reduce_dtype` (default: `flat`'s dtype); `divide_first`: average
    instead, dividing each rank's values by the world size in `reduce_dtype` before the
    sum (fp16, where the sum itself could overflow)."""
    if world_size == 1:
        return ReduceStats(0, 0)
    reduce_dtype = flat.dtype if reduce_dtype is None else reduce_dtype
    collectives = bytes_sent = 0
    for start in range(0, flat.numel(), bucket_numel):
        bucket = flat[start : start + bucket_numel]
        wire = bucket if reduce_dtype == flat.dtype else bucket.to(reduce_dtype)
        if divide_first:
            wire.div_(world_size)
        dist.all_reduce(wire, group=group)
        if wire is not bucket:
            bucket.copy_(wire)
        collectives += 1
        bytes_sent += wire.numel() * wire.element_size()
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
    scratch: dict[str, torch.Tensor] | None = None,
) -> ReduceStats:
    """Add the cross-rank sum of `rank`'s shard of `flat` (world_size * shard_numel,) into
    `shard_out` (shard_numel,), `bucket_numel` elements (all ranks together) per collective,
    each collective in `flat`'s dtype. `scratch`: a dict the caller keeps, where the
    collective's output buffer is allocated once and reused on later calls."""
    shard_numel = shard_out.numel()
    rank_views = flat.view(world_size, shard_numel)
    if world_size == 1:
        shard_out.add_(rank_views[0])
        return ReduceStats(0, 0)
    per_rank = max(1, bucket_numel // world_size)
    collectives = bytes_sent = 0
    for start in range(0, shard_numel, per_rank):
        end = min(start + per_rank, shard_numel)
        stacked = rank_views[:, start:end].contiguous()
        reduced = _scratch(scratch, end - start, flat.dtype, shard_out.device)
        _reduce_scatter_into(reduced, stacked.view(-1), group)
        shard_out[start:end].add_(reduced)
        collectives += 1
        bytes_sent += stacked.numel() * stacked.element_size()
    return ReduceStats(collectives, bytes_sent)


def _scratch(
    scratch: dict[str, torch.Tensor] | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A (numel,) buffer: from `scratch` when it holds one large enough of `dtype`, else new
    (and kept there)."""
    if scratch is None:
        return torch.empty(numel, dtype=dtype, device=device)
    key = f"reduce-scatter {dtype}"
    buffer = scratch.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        scratch[key] = buffer
    return buffer[:numel]


def all_reduce_sum(value: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None):
    """Sum a small tensor across ranks in place (a no-op with world size 1)."""
    if world_size > 1:
        dist.all_reduce(value, group=group)
    return value


def agree_on_kernels(
    choice: KernelChoice,
    group: dist.ProcessGroup | None,
    world_size: int,
    device: torch.device,
) -> KernelChoice:
    """The gather kernels every rank of `group` uses (collective, once at construction):
    `choice` (this rank's, qwz.kernels.choose_kernels) when every rank chose the same kind,
    else the eager kernels on every rank, with every rank's reason as the fallback. Both
    write the same bytes, but a rank whose fused kernels failed their self-test (its own
    GPU, its own compiler) must not make its peers run other kernels than it does, silently
    or by an error: each rank's record names the fallback instead."""
    if world_size == 1:
        return choice
    name = choice.kernels.name
    fused = torch.tensor([int(name == "fused")], dtype=torch.int64, device=device)
    dist.all_reduce(fused, group=group)
    fused_ranks = int(fused)
    if fused_ranks in (0, world_size):
        return choice
    reasons: list[tuple[str, str | None]] = [("", None)] * world_size
    dist.all_gather_object(reasons, (name, choice.fallback_reason), group=group)
    failed = "; ".join(
        f"rank {rank}: {reason}" for rank, (kind, reason) in enumerate(reasons) if kind != "fused"
    )
    return KernelChoice(
        EAGER_KERNELS,
        f"the fused kernels serve on {fused_ranks} of {world_size} ranks only, so every rank "
        f"runs the eager kernels ({failed})",
    )
