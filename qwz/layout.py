"""Flat-buffer partitioning: where each parameter lives, the padding, shard ranges, chunk plans.

Pure arithmetic on sizes; no tensors are allocated here.

[Note: padding rule]
A flat buffer holds its parameters back to back and is padded with zeros at the
end until its length is ``world_size * shard_numel`` where ``shard_numel`` is a
whole number of ``shard_alignment`` elements. For the exact region ([Note: small
parameters travel exactly]) the shard alignment is 1. For a quantized buffer it is
the quantization group size unless the caller asks for a positive multiple of it
(checked by :func:`shard_alignment`), so every rank's shard is a whole number of
groups and no group ever spans two ranks. The padding is zero in the working
copy, in the gradients and in the master shard, so it quantizes to zero codes
and never moves.

The layout alone decides an element's owner, its offset in the owner's shard
and so its gradient-reduction bucket and its position in every reduce-scatter
or all-reduce. A floating-point sum of three or more terms depends on its order,
and the collectives order the W ranks' terms by that position (a ring starts
each chunk at a different rank), so two engines whose layouts differ can reduce
identical gradients to different bits once W >= 3 (with W = 2, a + b == b + a).
Engines that must agree bit for bit -- the arms of a qualification, which differ
in group size -- are therefore given one shard alignment, a common multiple of
every group size among them (the harness uses their least common multiple).
The unused padding costs at most ``world_size * shard_alignment`` zero elements.

[Note: staging bound]
The weight gather moves each rank's shard in chunks. A chunk carries the same
number of whole groups (quantization groups, or elements for an exact region alone)
from every rank, so one collective of equal-sized rows serves it; the row also carries the chunk's
share of the exact elements ([Note: wire row], quant.py; [Note: small parameters travel
exactly]). Staging is allocated
once per gather plan and reused: two buffers, so that chunk k's collective runs
while chunk k + 1 is packed and chunk k - 1 decoded ([Note: gather pipeline],
collectives.py). Each buffer holds ``world_size`` rows of the largest chunk,
and the planner keeps *both buffers together* within the budget of
``allgather_bucket_size`` elements of the working dtype: each buffer gets half.
When half the budget cannot hold one unit (and one exact element) per rank, the
plan falls back to a single buffer with the smallest chunk -- one unit per rank,
plus one element of the exact region or the exact runs inside
that unit -- so a tiny budget still makes progress (and exceeds it by design,
as before, by that one minimal chunk).
So, for every plan::

    staging_bytes = num_buffers * world_size * max(row_bytes)
                 <= max(bucket_bytes, world_size * minimal_row_bytes)

[Note: small parameters travel exactly]
Parameters of at most ``preserve_numel`` elements (biases, norms, gates) are never
quantized: their elements -- the *exact elements* -- are cast from the fp32 master to the
working dtype and travel in the exact part of the same wire rows, after the codes
([Note: wire row], quant.py). "Exact" is the idea's one name: ``exact_numel`` counts exact
elements (a row's, a record's), an :class:`ExactPiece` is a run of them in one chunk's row,
``OwnShard.exact_mask`` marks them in a shard (shards.py), and the harness's own contract
asks whether a parameter ``travels_exactly`` (qualify/evidence/spec.py). The threshold keeps
the public key's name end to end (``zero_quantized_weights_preserve_numel``, default 65,536,
also a field of the checkpoint manifest); the harness, which never imports the code it
judges, holds its own copy as ``spec.EXACT_MAX_NUMEL``.

One planner (:func:`plan_gather`), one row format and one gather
(:func:`qwz.collectives.gather`) serve both users; they differ only in where the exact
elements sit in memory:

* *The exact region* (qwz's engine, optimizer.py). The engine owns its layout, so it packs
  the small parameters into a flat buffer of their own (shard alignment 1) beside the
  quantized region. ``plan_gather(exact_numel=...)`` spreads each rank's exact shard evenly
  over the chunks. No quantization group ever holds an exact element, so nothing is masked.
* *Exact runs* (the DeepSpeed drop-in, integrations/deepspeed/gather.py). DeepSpeed owns the
  flat partitions -- parameters back to back in its order, equal partitions per rank -- and
  its reductions and checkpoints depend on them, so the small parameters stay where they
  are: ``plan_gather(exact_runs=...)`` takes each rank's ``[start, end)`` runs of exact
  elements inside its partition, each travels with the chunk that covers it and is written
  after that chunk's decode, and a group that mixes quantized and exact elements is
  re-encoded with the exact ones zeroed (:class:`qwz.collectives.MaskedGroups`).

Why not one placement: the engine cannot take the masked form without changing its layout,
and the layout decides every element's owner and offset, hence the order of every gradient
reduction and the final weights ([Note: padding rule]); the drop-in cannot take a region
without re-laying out DeepSpeed's partitions. Both meet the same contract (a group's scale
comes from its quantized elements only, the exact elements are the master's cast): in the
engine the masking is simply vacuous.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qwz.quant import SCALE_BYTES, WireRow
from qwz.sizes import ceil_div

__all__ = ["SCALE_BYTES"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    """First element in the flat buffer."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed into one flat buffer, padded and split into equal rank shards."""

    slots: tuple[ParamSlot, ...]
    world_size: int
    shard_alignment: int
    """Each shard is a whole number of these elements (see [Note: padding rule])."""

    @property
    def numel(self) -> int:
        """Elements that belong to parameters."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        units_per_shard = ceil_div(self.numel, self.world_size * self.shard_alignment)
        return units_per_shard * self.shard_alignment

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def build_layout(
    named_shapes: Sequence[tuple[str, torch.Size]], world_size: int, shard_alignment: int
) -> FlatLayout:
    """Pack parameters back to back in the given order; see [Note: padding rule]."""
    if world_size < 1 or shard_alignment < 1:
        raise ValueError(
            f"world_size={world_size}, shard_alignment={shard_alignment}: both must be >= 1"
        )
    slots, offset = [], 0
    for name, shape in named_shapes:
        slots.append(ParamSlot(name=name, shape=torch.Size(shape), offset=offset))
        offset += torch.Size(shape).numel()
    return FlatLayout(slots=tuple(slots), world_size=world_size, shard_alignment=shard_alignment)


def resolve_shard_alignment(requested: int | None, *, group_size: int, quantize: bool) -> int:
    """The alignment of a quantized buffer's shards ([Note: padding rule]): `requested`, or
    `group_size` when it is None. Raises ValueError naming the value and the rule unless it
    is a positive integer and, when quantizing, a multiple of `group_size` (a shard must be
    whole groups). An unquantized buffer (the reference arm) takes any positive alignment."""
    if requested is None:
        return group_size
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"shard_alignment: {requested!r} is invalid: must be a positive integer")
    if quantize and requested % group_size:
        raise ValueError(
            f"shard_alignment: {requested} is invalid: must be a positive multiple of the "
            f"quantization group size {group_size}, so that every shard holds whole groups"
        )
    return requested


def split_by_size(
    named_shapes: Sequence[tuple[str, torch.Size]], preserve_numel: int
) -> tuple[list[tuple[str, torch.Size]], list[tuple[str, torch.Size]]]:
    """(exact, quantizable): parameters of at most `preserve_numel` elements travel exactly
    ([Note: small parameters travel exactly])."""
    exact = [(n, s) for n, s in named_shapes if torch.Size(s).numel() <= preserve_numel]
    large = [(n, s) for n, s in named_shapes if torch.Size(s).numel() > preserve_numel]
    return exact, large


def quantized_unit_bytes(group_size: int) -> int:
    """Staging bytes of one quantization group: int8 codes plus one fp32 scale."""
    return group_size + SCALE_BYTES


# --------------------------------------------------------------------------- #
# Gather plans: chunks whose rows carry quantized groups and exact elements
# --------------------------------------------------------------------------- #


class ExactPiece(NamedTuple):
    """A run of exact elements in one chunk's row ([Note: small parameters travel exactly]):
    ``numel`` elements of `owner`'s exact source (its exact region shard, or its partition
    for exact runs) from ``source_offset``, at ``row_offset`` of the row's exact part,
    written to the owner's row of the exact destination at ``dest_offset``."""

    owner: int
    source_offset: int
    dest_offset: int
    row_offset: int
    numel: int


class GatherChunk(NamedTuple):
    """One collective: main-stream elements [start, end) of every rank's shard (``end`` is
    at most the real source length; quantized rows zero-pad the last group) and the exact
    pieces that ride in the same rows."""

    start: int
    end: int
    row: WireRow
    pieces: tuple[ExactPiece, ...]


@dataclass(frozen=True)
class GatherPlan:
    """Every chunk of one gather, and the staging it needs; see [Note: staging bound]."""

    world_size: int
    quantize: bool
    group_size: int | None
    """Elements per group of the main stream (the quantization group when quantizing);
    None: an unquantized stream moved element by element."""
    source_numel: int
    """Real elements of each rank's main stream (the padded shard may be longer)."""
    chunks: tuple[GatherChunk, ...]
    num_buffers: int
    """2: double-buffered pipeline; 1: the budget holds only one minimal chunk."""

    @property
    def row_bytes(self) -> int:
        """Bytes of the largest row (one rank, one chunk)."""
        return max((chunk.row.row_bytes for chunk in self.chunks), default=0)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one staging buffer (all ranks' rows of the largest chunk)."""
        return self.world_size * self.row_bytes

    @property
    def staging_bytes(self) -> int:
        """Bytes of all staging buffers together: what [Note: staging bound] bounds."""
        return self.num_buffers * self.buffer_bytes

    def wire_bytes(self) -> int:
        """Bytes one rank contributes to the gather's collectives (0 with one rank)."""
        if self.world_size == 1:
            return 0
        return sum(chunk.row.row_bytes for chunk in self.chunks)


def _exact_region_pieces(
    exact_numel: int, world_size: int, num_chunks: int
) -> list[tuple[ExactPiece, ...]]:
    """An exact region's `exact_numel` elements per rank (every rank the same, in a buffer of
    their own) spread evenly over the chunks, each rank's run to its own row."""
    quota = ceil_div(exact_numel, num_chunks)
    result = []
    for index in range(num_chunks):
        first = min(index * quota, exact_numel)
        numel = min(quota, exact_numel - first)
        pieces = tuple(ExactPiece(owner, first, first, 0, numel) for owner in range(world_size))
        result.append(pieces if numel else ())
    return result


def _exact_run_pieces(
    runs: Sequence[Sequence[tuple[int, int]]], ranges: Sequence[tuple[int, int]]
) -> list[tuple[ExactPiece, ...]]:
    """Exact runs inside the main stream's own buffer: `runs[owner]` are sorted,
    disjoint [start, end) ranges of the owner's shard. Each travels with the chunk whose
    range holds it, so it is written after that chunk's quantized decode."""
    starts = [[start for start, _ in owner_runs] for owner_runs in runs]
    result = []
    for first, last in ranges:
        pieces = []
        for owner, owner_runs in enumerate(runs):
            row_offset = 0
            index = max(0, bisect.bisect_right(starts[owner], first) - 1)
            for start, end in owner_runs[index:]:
                if start >= last:
                    break
                low, high = max(start, first), min(end, last)
                if low < high:
                    pieces.append(ExactPiece(owner, low, low, row_offset, high - low))
                    row_offset += high - low
        result.append(tuple(pieces))
    return result


PIPELINE_CHUNK_NUMEL = 1 << 22
"""[Note: chunks to overlap]
The staging bound caps a chunk; it does not ask for one chunk when the bound
allows it. A single chunk leaves the gather pipeline ([Note: gather pipeline],
collectives.py) nothing to overlap: encode, collective and decode run one
after the other. So a shard is also cut into chunks of at most this many
source elements per rank, so that chunk k's collective overlaps the packing of
chunk k + 1 and the decode of chunk k - 1. Too small a chunk pays the fixed cost
of a collective too often; the value is tuned with benchmarks/gather.py.
Smaller chunks only shrink the staging, so the bound still holds."""


class _StreamLayout(NamedTuple):
    """What :func:`plan_gather` cuts into chunks: every rank's main stream of `source_numel`
    elements in units of `unit_numel` (whole groups when quantized), and its exact elements
    (a region of `exact_numel` per rank, or `exact_runs` inside the main stream)."""

    world_size: int
    source_numel: int
    quantize: bool
    unit_numel: int
    element_size: int
    exact_numel: int
    exact_runs: Sequence[Sequence[tuple[int, int]]] | None

    def chunks(self, num_chunks: int) -> tuple[GatherChunk, ...]:
        """The stream in `num_chunks` chunks of whole units (fewer where it runs out), each
        with its wire row and the exact pieces it carries."""
        source_numel, unit_numel, world_size = self.source_numel, self.unit_numel, self.world_size
        step = ceil_div(ceil_div(source_numel, unit_numel), num_chunks) * unit_numel
        starts = range(0, source_numel, step) if source_numel else range(0)
        ranges = [(start, min(start + step, source_numel)) for start in starts]
        if self.exact_runs is not None:
            all_pieces = _exact_run_pieces(self.exact_runs, ranges)
        else:
            ranges += [(source_numel, source_numel)] * (num_chunks - len(ranges))
            all_pieces = _exact_region_pieces(self.exact_numel, world_size, len(ranges))
        chunks = []
        for (start, end), pieces in zip(ranges, all_pieces, strict=True):
            counts = [0] * world_size
            for piece in pieces:
                counts[piece.owner] += piece.numel
            exact = max(counts)
            if end == start and not exact:
                continue
            if self.quantize:
                groups = ceil_div(end - start, unit_numel)
                row = WireRow(groups, unit_numel, exact, self.element_size)
            else:
                row = WireRow(0, unit_numel, exact, self.element_size, raw_numel=end - start)
            chunks.append(GatherChunk(start, end, row, pieces))
        return tuple(chunks)


def plan_gather(
    *,
    world_size: int,
    source_numel: int,
    quantize: bool,
    group_size: int | None,
    element_size: int,
    bucket_bytes: int,
    exact_numel: int = 0,
    exact_runs: Sequence[Sequence[tuple[int, int]]] | None = None,
    pipeline_numel: int | None = None,
) -> GatherPlan:
    """Plan a gather of every rank's main stream of `source_numel` real elements, in whole
    groups of `group_size` elements (the quantization groups when `quantize`, the last one
    zero-padded; an unquantized stream cut the same way chunks like a quantized one), or
    element by element when `group_size` is None (unquantized only), plus the exact
    elements ([Note: small parameters travel exactly]): either an exact region of
    `exact_numel` elements per rank in a buffer of its own, spread evenly over the chunks,
    or `exact_runs` per rank inside the main stream's buffer, each with the chunk that
    covers it. Picks the fewest chunks whose staging keeps [Note: staging bound], and
    at least one per `pipeline_numel` (default :data:`PIPELINE_CHUNK_NUMEL`) source elements
    ([Note: chunks to overlap])."""
    if exact_numel and exact_runs is not None:
        raise ValueError("exact_numel and exact_runs: give an exact region or exact runs, not both")
    if quantize and group_size is None:
        raise ValueError("group_size: None is invalid when quantizing: give the group size")
    unit_numel = 1 if group_size is None else group_size
    units = ceil_div(source_numel, unit_numel)
    layout = _StreamLayout(
        world_size, source_numel, quantize, unit_numel, element_size, exact_numel, exact_runs
    )
    most_chunks = max(units, exact_numel, 1)
    pipeline_numel = PIPELINE_CHUNK_NUMEL if pipeline_numel is None else pipeline_numel
    fewest_chunks = min(most_chunks, max(1, ceil_div(source_numel, max(1, pipeline_numel))))
    for num_buffers in (2, 1):
        buffer_bytes = bucket_bytes // num_buffers
        num_chunks = fewest_chunks
        while True:
            chunks = layout.chunks(num_chunks)
            needed = world_size * max((chunk.row.row_bytes for chunk in chunks), default=0)
            if needed <= buffer_bytes or num_chunks >= most_chunks:
                break
            grown = ceil_div(num_chunks * needed, max(buffer_bytes, 1))
            num_chunks = min(most_chunks, max(num_chunks + 1, grown))
        if needed <= buffer_bytes:
            return GatherPlan(world_size, quantize, group_size, source_numel, chunks, num_buffers)
    return GatherPlan(world_size, quantize, group_size, source_numel, chunks, 1)
