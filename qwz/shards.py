"""The public seam through which anything outside an engine reads a rank's own shards.

[Note: own shards]
ZeRO-1/2 gives every rank one shard of the fp32 master weights (and of the
optimizer state). ``own_shards()`` -- on :class:`qwz.optimizer.ZeroOptimizer`
and on the optimizer returned by the DeepSpeed drop-in, stock or taken over --
returns one :class:`OwnShard` per flat buffer (qwz's regions, DeepSpeed's param
groups) describing that shard:

* ``master``: the (n,) fp32 master shard, a live view; the torch optimizer
  ``shard_optimizer`` steps exactly these tensors.
* ``working``: the (n,) working-dtype values of the same elements in this
  rank's model, a live view: what the weight gather wrote there.
* ``group_size`` / ``exact_mask``: how those elements travel -- quantized in groups
  of ``group_size`` consecutive shard elements (the group grid starts at the
  shard's first element), except the exact elements, where ``exact_mask`` is True
  ([Note: small parameters travel exactly], layout.py); ``group_size`` None
  means everything travels exactly.
* ``scales``: the (ceil(n / G),) fp32 scale of each group, computed from the
  master with the exact elements zeroed -- the scales the gather must have
  used (``qwz.quant``'s one formula); None when nothing is quantized.
* ``slots``: which parameter each element range belongs to, so a check can
  name the parameter (and the element within it) that went wrong.

The harness (``qwz.qualify``) reads engines through this seam and the torch
optimizer alone; nothing here depends on how an engine lays out its buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from qwz import quant


class ShardSlot(NamedTuple):
    """One parameter's elements inside a shard."""

    name: str
    start: int
    """First shard position of this parameter's elements."""
    end: int
    """One past the last shard position."""
    param_offset: int
    """Index, in the flattened parameter, of the element at shard position ``start``."""


class OwnShard(NamedTuple):
    """This rank's shard of one flat buffer; see [Note: own shards]."""

    name: str
    master: torch.Tensor
    """(n,) fp32, live: the very tensor the torch optimizer steps (its ``.grad`` and optimizer
    state are keyed by it); read it, never write it."""
    working: torch.Tensor
    """(n,) working dtype, live: this rank's gathered values of the same elements."""
    group_size: int | None
    """Quantization group of the wire; None when the shard travels exactly."""
    exact_mask: torch.Tensor | None
    """(n,) bool: the exact elements, which travel exactly although ``group_size`` is set
    (exact runs); None: none (an exact region is a shard of its own, ``group_size`` None)."""
    scales: torch.Tensor | None
    """(ceil(n / group_size),) fp32: each group's scale as the gather must compute it."""
    slots: tuple[ShardSlot, ...]


def slots_in_range(
    ranges: Iterable[tuple[str, int, int]], shard_start: int, shard_end: int
) -> tuple[ShardSlot, ...]:
    """The slots of the parameters overlapping ``[shard_start, shard_end)`` of a flat buffer.

    ``ranges``: ``(name, flat_offset, numel)`` of each parameter in the flat buffer."""
    slots = []
    for name, offset, numel in ranges:
        first, last = max(offset, shard_start), min(offset + numel, shard_end)
        if first < last:
            slots.append(ShardSlot(name, first - shard_start, last - shard_start, first - offset))
    return tuple(sorted(slots, key=lambda slot: slot.start))


@torch.no_grad()
def shard_scales(
    master: torch.Tensor, group_size: int, exact_mask: torch.Tensor | None
) -> torch.Tensor:
    """Each group's scale from the master with exact elements zeroed (see the note)."""
    values = master.detach().float().reshape(-1)
    if exact_mask is not None:
        values = torch.where(exact_mask, torch.zeros_like(values), values)
    return quant.group_scales(values, group_size)


def make_own_shard(
    name: str,
    master: torch.Tensor,
    working: torch.Tensor,
    group_size: int | None,
    exact_mask: torch.Tensor | None,
    slots: Sequence[ShardSlot],
) -> OwnShard:
    scales = None if group_size is None else shard_scales(master, group_size, exact_mask)
    return OwnShard(name, master, working, group_size, exact_mask, scales, tuple(slots))


def slot_of(shard: OwnShard, position: int) -> tuple[str, int]:
    """The parameter name and element index of shard position ``position``; ("(padding)", -1)
    for positions no parameter covers."""
    for slot in shard.slots:
        if slot.start <= position < slot.end:
            return slot.name, slot.param_offset + position - slot.start
    return "(padding)", -1
