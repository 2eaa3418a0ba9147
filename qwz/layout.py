"""Flat-buffer partitioning: where each parameter lives, the padding, shard ranges, chunk plans.

Pure arithmetic on sizes; no tensors are allocated here.

[Note: padding rule]
A flat buffer holds its parameters back to back and is padded with zeros at the
end until its length is ``world_size * shard_numel`` where ``shard_numel`` is a
whole number of ``alignment`` elements. For a quantized buffer the alignment is
the quantization group size, so every rank's shard is a whole number of groups
and no group ever spans two ranks; for an exact buffer it is 1. The padding is
zero in the working copy, in the gradients and in the master shard, so it
quantizes to zero codes and never moves.

[Note: staging bound]
The weight gather moves each rank's shard in chunks. A chunk carries the same
number of alignment units (quantization groups) from every rank, so one
collective of equal-sized inputs serves it. Its staging buffer (for a quantized
buffer: int8 codes plus fp32 scales; otherwise the working dtype) holds
``world_size * units_per_chunk * unit_bytes`` bytes, and ``units_per_chunk`` is
the largest count that keeps this within the budget of
``allgather_bucket_size`` elements of the working dtype -- except that a chunk
always carries at least one unit per rank, so a budget smaller than
``world_size`` units still makes progress (and exceeds it by design).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

SCALE_BYTES = 4
"""Bytes of one fp32 scale on the wire."""


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
    alignment: int
    """Each shard is a whole number of these elements (see [Note: padding rule])."""

    @property
    def numel(self) -> int:
        """Elements that belong to parameters."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        unit = self.world_size * self.alignment
        return -(-self.numel // unit) * self.alignment

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def names_in_range(self, start: int, end: int) -> list[str]:
        """Names of parameters that overlap the flat range [start, end)."""
        return [slot.name for slot in self.slots if max(start, slot.offset) < min(end, slot.end)]


def build_layout(
    named_shapes: Sequence[tuple[str, torch.Size]], world_size: int, alignment: int
) -> FlatLayout:
    """Pack parameters back to back in the given order; see [Note: padding rule]."""
    if world_size < 1 or alignment < 1:
        raise ValueError(f"world_size={world_size}, alignment={alignment}: both must be >= 1")
    slots, offset = [], 0
    for name, shape in named_shapes:
        slots.append(ParamSlot(name=name, shape=torch.Size(shape), offset=offset))
        offset += torch.Size(shape).numel()
    return FlatLayout(slots=tuple(slots), world_size=world_size, alignment=alignment)


def split_by_size(
    named_shapes: Sequence[tuple[str, torch.Size]], preserve_numel: int
) -> tuple[list[tuple[str, torch.Size]], list[tuple[str, torch.Size]]]:
    """(exact, quantizable): parameters of at most `preserve_numel` elements travel exactly."""
    exact = [(n, s) for n, s in named_shapes if torch.Size(s).numel() <= preserve_numel]
    large = [(n, s) for n, s in named_shapes if torch.Size(s).numel() > preserve_numel]
    return exact, large


@dataclass(frozen=True)
class ChunkPlan:
    """How one shard is cut into gather chunks; see [Note: staging bound]."""

    shard_numel: int
    chunk_numel: int
    """Elements per rank per chunk (a whole number of units; the last chunk may be shorter)."""
    unit_numel: int
    unit_bytes: int
    """Staging bytes one unit of one rank occupies."""
    world_size: int

    def chunks(self) -> Iterator[tuple[int, int]]:
        """[start, end) of each chunk, relative to the shard."""
        for start in range(0, self.shard_numel, self.chunk_numel):
            yield start, min(start + self.chunk_numel, self.shard_numel)

    @property
    def num_chunks(self) -> int:
        return -(-self.shard_numel // self.chunk_numel) if self.shard_numel else 0

    @property
    def staging_bytes(self) -> int:
        """Bytes of the largest chunk's staging buffer, all ranks together."""
        return self.world_size * (self.chunk_numel // self.unit_numel) * self.unit_bytes


def plan_chunks(
    shard_numel: int,
    world_size: int,
    unit_numel: int,
    unit_bytes: int,
    budget_bytes: int,
) -> ChunkPlan:
    """Largest chunk whose staging fits `budget_bytes`, but at least one unit per rank."""
    if shard_numel % unit_numel:
        raise ValueError(f"shard_numel={shard_numel} is not a multiple of unit_numel={unit_numel}")
    units_per_shard = shard_numel // unit_numel
    units_per_chunk = max(1, min(units_per_shard, budget_bytes // (world_size * unit_bytes)))
    return ChunkPlan(
        shard_numel=shard_numel,
        chunk_numel=units_per_chunk * unit_numel,
        unit_numel=unit_numel,
        unit_bytes=unit_bytes,
        world_size=world_size,
    )


def quantized_unit_bytes(group_size: int) -> int:
    """Staging bytes of one quantization group: int8 codes plus one fp32 scale."""
    return group_size + SCALE_BYTES
