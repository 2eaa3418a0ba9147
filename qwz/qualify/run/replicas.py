"""Which ranks must hold the same parameters, and the checks that compare ranks, per set.

[Note: replica sets]
Data parallelism puts the same model on every rank; expert parallelism does not: with
DeepSpeed's MoE, a rank holds only its own experts, so an expert parameter of one name
(``...deepspeed_experts.0.weight``, the *local* index) holds different experts on
different ranks. Every check that compares ranks compares a parameter over the ranks that
hold the same thing -- its *replica set* -- never over all ranks:

* the workload says what each rank holds (``Workload.replica_keys``: per parameter name a
  key, ``dense`` or ``expert<global index>``, from the model's definition, never from the
  engine's process groups), and :meth:`ReplicaSets.agree` gathers every rank's keys once
  per arm: the replica set of (rank, name) is the ranks with the same key for that name;
* replicas (:func:`divergence`): after every step each rank's per-parameter digests are
  gathered, and a parameter diverges when a rank's digest differs from any rank of its set;
* masters (:func:`master_digests`, after step 1 and, short, after every step): a
  parameter's master digest is summed over the ranks of its set only (each holds a shard of
  it), one digest per (name, key), named ``name`` for dense parameters and
  ``name@expert<i>`` for experts;
* final hashes (:func:`final_hashes`): per rank, one hash per key it holds; the record
  keeps each key's hashes over its set, which must agree.

Without experts every key is ``dense`` and each of these is the all-ranks check it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwz import shards as seam
from qwz.hashing import tensors_hashes
from qwz.qualify.run.moe import DENSE
from qwz.qualify.run.observers import digest


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_rows(row: torch.Tensor) -> torch.Tensor:
    """(world, n): every rank's (n,) `row`, on every rank (collective)."""
    _, world = _world()
    if world == 1:
        return row.reshape(1, -1)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row.contiguous())
    return torch.stack(rows)


@dataclass(frozen=True)
class ReplicaSets:
    """Every rank's replica keys of one arm's parameters ([Note: replica sets])."""

    names: tuple[str, ...]
    """The parameter names, in the model's order (the same on every rank)."""
    keys: tuple[tuple[str, ...], ...]
    """keys[rank][i]: what `rank` holds as parameter ``names[i]``."""

    @classmethod
    def agree(cls, keys: dict[str, str]) -> ReplicaSets:
        """Every rank's `keys` (name -> key, in the model's order), gathered (collective)."""
        rank, world = _world()
        gathered: list[dict[str, str]] = [keys]
        if world > 1:
            gathered = [{}] * world
            dist.all_gather_object(gathered, keys)
        names = tuple(keys)
        for other, theirs in enumerate(gathered):
            if tuple(theirs) != names:
                raise ValueError(
                    f"replica sets: rank {other}'s parameters are not rank {rank}'s "
                    f"({len(theirs)} vs {len(names)} names): the ranks built different models"
                )
        return cls(names, tuple(tuple(theirs[name] for name in names) for theirs in gathered))

    def holders(self, index: int, key: str) -> tuple[int, ...]:
        """The ranks holding `key` as parameter ``names[index]``."""
        return tuple(rank for rank, keys in enumerate(self.keys) if keys[index] == key)

    def label(self, index: int, key: str) -> str:
        """``name`` for a dense parameter, ``name@key`` for an expert's."""
        name = self.names[index]
        return name if key == DENSE else f"{name}@{key}"

    def entries(self) -> list[tuple[int, str, tuple[int, ...]]]:
        """(name index, key, its replica set) for every distinct (name, key), in name order."""
        found = []
        for index in range(len(self.names)):
            for key in dict.fromkeys(keys[index] for keys in self.keys):
                found.append((index, key, self.holders(index, key)))
        return found

    def key_sets(self) -> dict[str, tuple[int, ...]]:
        """Per key, the ranks holding it (as any parameter)."""
        sets: dict[str, set[int]] = {}
        for rank, keys in enumerate(self.keys):
            for key in keys:
                sets.setdefault(key, set()).add(rank)
        return {key: tuple(sorted(ranks)) for key, ranks in sorted(sets.items())}


@torch.no_grad()
def divergence(module: torch.nn.Module, sets: ReplicaSets) -> list[str]:
    """The parameters whose working copies differ within their replica set, labelled with the
    set's ranks where it is not every rank (collective; the same list on every rank)."""
    _, world = _world()
    names, digests = digest.replica_digests(module)
    if tuple(names) != sets.names:
        raise ValueError("replica sets: the module's parameters are not the sets' names")
    if world == 1:
        return []
    every_rank = _gather_rows(digests).cpu()  # (world, parameters)
    divergent = []
    for index, key, ranks in sets.entries():
        if len({int(every_rank[rank, index]) for rank in ranks}) > 1:
            where = "" if len(ranks) == world else f" (ranks {', '.join(map(str, ranks))})"
            divergent.append(sets.label(index, key) + where)
    return divergent


@torch.no_grad()
def master_digests(shards: Sequence[seam.OwnShard], sets: ReplicaSets) -> dict[str, str]:
    """Per (parameter, key), the digest of its fp32 master summed over its replica set
    ([Note: layout-independent digests], observers/digest.py); collective, the same on every
    rank."""
    local = digest.master_digest_sums(shards, sets.names)
    every_rank = _gather_rows(local).cpu()  # (world, parameters)
    digests = {}
    for index, key, ranks in sets.entries():
        total = int(every_rank[list(ranks), index].sum())
        digests[sets.label(index, key)] = f"{total:016x}"
    return digests


def short_digests(digests: dict[str, str]) -> dict[str, str]:
    """Each of :func:`master_digests` cut to its low 32 bits, 8 hex digits ([Note: short
    digests], observers/digest.py): what the record keeps after every step."""
    return {label: value[-digest.SHORT_HEX_DIGITS :] for label, value in digests.items()}


@torch.no_grad()
def final_hashes(module: torch.nn.Module, keys: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The hash of all of this rank's parameters (qwz.param_hash), and per key this rank
    holds the hash of its parameters with that key, from one read of each parameter (not
    collective)."""
    return tensors_hashes(module.named_parameters(), keys)


def wire_kind(slot_names: Sequence[str], keys: dict[str, str]) -> str:
    """What a process group's shards carry: ``dense``, ``expert`` or ``mixed`` (both)."""
    kinds = {DENSE if keys.get(name, DENSE) == DENSE else "expert" for name in slot_names}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else DENSE)
