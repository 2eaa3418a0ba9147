"""Per-parameter digests of masters and replicas that do not depend on the layout.

[Note: layout-independent digests]
Two arms may shard differently (the group size changes the padding), so the
harness compares masters and replicas by per-parameter digests that do not
depend on who owns which element: for element ``i`` of a parameter with value
bits ``b``, ``term = ((b xor (i * K1)) * K2) mod 2**32`` (K2 odd), summed over
the elements each rank owns and then over ranks (int64, no overflow below 2**31
elements per parameter). Two parameters that differ in exactly one element
always get different digests (the term is a bijection of ``b`` for fixed
``i``), and any other difference is missed with probability about 2**-32.

[Note: short digests]
After every step (not only step 1) the record keeps each parameter's digest cut to its low 32
bits, 8 hex digits, so a long run's record stays small. The cut loses neither property above:
the terms are defined modulo 2**32, so a difference in one element changes the sum modulo
2**32 too, and any other difference is still missed with probability about 2**-32. What
reads them: the review of a pull request, which compares its base's and its head's reference
arm step by step (qualify/evidence/default_path.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from qwz import shards as seam
from qwz.qualify.run.observers.piecewise import all_reduce, piece_numel

K1 = 0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF


K2 = 0x85EBCA6B


MASK32 = 0xFFFFFFFF
SHORT_HEX_DIGITS = 8
"""[Note: short digests]: the low 32 bits of a digest, in hex."""


def _digest_sum(values: torch.Tensor, first_index: int) -> torch.Tensor:
    """int64 sum of the terms of [Note: layout-independent digests] of flat `values`, whose
    first element is element `first_index` of its parameter.

    The term is computed modulo 2**32 in int32, whose products wrap modulo 2**32 as the
    definition's do; a term read as int32 is its unsigned value minus 2**32 when negative,
    so the unsigned sum is the int32 sum plus 2**32 per negative term."""
    bits = values.detach().float().contiguous().view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    piece = piece_numel(values.device)  # bounded temporaries on every device
    # (j * K1) mod 2**32 for j in a piece, by the same int32 wrap.
    offsets = torch.arange(min(bits.numel(), piece), dtype=torch.int32, device=values.device)
    offsets *= _as_int32(K1 & MASK32)
    for start in range(0, bits.numel(), piece):
        chunk = bits[start : start + piece]
        # ((first + start + j) * K1) mod 2**32 = (first + start) * K1 + j * K1, mod 2**32.
        base = _as_int32(((first_index + start) * K1) & MASK32)
        terms = (offsets[: chunk.numel()] + base) ^ chunk
        terms *= _as_int32(K2)
        total += terms.sum(dtype=torch.int64) + (terms < 0).sum() * (MASK32 + 1)
    return total


def _as_int32(value: int) -> int:
    """`value` in [0, 2**32) as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


@torch.no_grad()
def master_digest_sums(shards: Sequence[seam.OwnShard], names: Sequence[str]) -> torch.Tensor:
    """(len(names),) int64: per parameter, this rank's part of the digest of its fp32 master
    ([Note: layout-independent digests]): the sum over the elements this rank owns (not
    collective)."""
    position = {name: index for index, name in enumerate(names)}
    device = shards[0].master.device if shards else torch.device("cpu")
    sums = torch.zeros(len(names), dtype=torch.int64, device=device)
    for shard in shards:
        master = shard.master.detach().reshape(-1)
        for slot in shard.slots:
            sums[position[slot.name]] += _digest_sum(
                master[slot.start : slot.end], slot.param_offset
            )
    return sums


@torch.no_grad()
def master_digests(shards: Sequence[seam.OwnShard], names: Sequence[str]) -> dict[str, str]:
    """Per parameter, the digest of its fp32 master over all ranks ([Note: layout-independent
    digests]); collective: every rank must call it."""
    sums = all_reduce(master_digest_sums(shards, names))
    return {name: f"{int(value):016x}" for name, value in zip(names, sums.tolist(), strict=True)}


@torch.no_grad()
def replica_digests(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, int64 digest per parameter) of this rank's working copy (not collective)."""
    names, digests = [], []
    for name, param in module.named_parameters():
        names.append(name)
        digests.append(_digest_sum(param.detach().reshape(-1), 0))
    return names, torch.stack(digests)


@torch.no_grad()
def replica_divergence(module: torch.nn.Module) -> list[str]:
    """Names of the parameters whose working copies differ between ranks (collective)."""
    names, digests = replica_digests(module)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []
    low, high = digests.clone(), digests.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return [name for name, differs in zip(names, (low != high).tolist(), strict=True) if differs]
