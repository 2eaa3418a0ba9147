"""The chunked candidate arm: a bucket sized from the workload, so that chunk edges are judged.

[Note: the chunked arm]
DeepSpeed's default ``allgather_bucket_size`` (5e8 elements) holds every CPU workload's
partition in one chunk, so a gather wrong only at a chunk edge (an element left stale, groups
restarted where a chunk starts) or one that ignores the bucket altogether passes a
qualification that never chunks. So the plan gets one more candidate arm,
``candidate-g<G>-chunked`` at the run's smallest group size, the same as ``candidate-g<G>`` in
everything but its ``allgather_bucket_size``, which is sized here from the workload -- from the
parameter sizes of each param group the subject gathers and the ranks it gathers it over, never
from an implementation's layout, so it holds for qwz's engine and DeepSpeed's flat groups alike:

- any gather within the staging bound ([Note: the staging bound], evidence/staging.py) needs at
  least ``CHUNK_TARGET`` collectives per param group: the bytes its ranks' rows take in the
  spec's encoding, at least ``T = q (1 + 4/G) + x b`` for ``q`` quantized and ``x`` exact
  elements (padding only adds), hold ``CHUNK_TARGET`` bounds. Sixteen: then a buffer the size of
  the partition -- a receive buffer allocated up front, the whole partition quantized before the
  first call, every chunk's buffers kept -- exceeds what a correct gather may hold at once
  ([Note: the gather's memory, exactly], evidence/staging.py: about twenty chunks' worth of
  bytes per rank) by a margin, and many chunks per rank remain whatever the padding, for a
  gather whose collectives carry every rank's row (an all-gather; one broadcast per source
  carries one row, so the bound alone would let its chunks be W times larger: the PR's own
  chunking, ``bucket // (W_g * G)`` groups per rank, keeps the count). qwz's engine keeps both
  staging buffers within the bucket: its chunks are smaller still;
- it is a multiple of ``W * G`` (W the world size; an expert group's ranks divide it), so the
  PR's chunks -- ``bucket // (W_g * G)`` groups per rank -- are whole groups;
- of such buckets it is the largest whose chunk edges under the PR's chunking of DeepSpeed's
  flat group (the group's parameters back to back, equal partitions) all fall strictly inside a
  parameter: on no parameter's first element and in no padding (if none of the next
  ``EDGE_TRIES`` smaller ones does, the largest).

The arm exists only where the run's own bucket is larger than the sized one: a run whose bucket
already chunks (``--allgather-bucket-size 65536`` on the small workloads) judges the chunked
path through its candidates. Chunks of whole groups change no decoded value and
``reduce_bucket_size`` stays the run's, so ``step1-exact`` and every other check hold the arm to
the reference as any candidate (its trajectory is its sibling's). It is not timed: the speed
claim is about the user's bucket, and timing one sized to force chunking on a CPU workload
would time the harness's choice, at blocks x 2 x (warm-up + block) more steps.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from qwz.qualify.evidence import spec, staging
from qwz.qualify.run.workloads import Workload

CHUNK_TARGET = 16
"""Collectives per param group that any gather within the staging bound needs (module note)."""
EDGE_TRIES = 16
"""Smaller buckets tried for one whose chunk edges all fall inside parameters."""
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one element of each working dtype the plan knows."""


class GatheredGroup(NamedTuple):
    """One param group as its gather sees it."""

    numels: tuple[int, ...]
    """Its parameters' sizes, in the group's order (DeepSpeed flattens them so)."""
    world_size: int
    """The ranks its weights are gathered over (an expert group: the expert-data-parallel
    ranks, W / ep_size)."""


@functools.cache
def _groups(name: str, params_json: str, world_size: int, seed: int) -> tuple[GatheredGroup, ...]:
    import torch

    workload = Workload(name, json.loads(params_json))
    with torch.device("meta"):  # shapes only
        model = workload.build_model(seed)
    param_groups = workload.optimizer_parameters(model)
    if not all(isinstance(group, dict) for group in param_groups):
        param_groups = [{"params": param_groups}]
    expert_world = world_size // workload.params.get("ep_size", 1)
    return tuple(
        GatheredGroup(
            tuple(param.numel() for param in group["params"]),
            expert_world if group.get("moe") else world_size,
        )
        for group in param_groups
    )


def gathered_groups(workload: Workload, world_size: int, seed: int) -> list[GatheredGroup]:
    """The param groups a subject gathers, from the workload's model on the meta device and
    the param groups it hands DeepSpeed (experts apart: [Note: MoE workload], run/moe.py)."""
    params = json.dumps(workload.params, sort_keys=True)
    return list(_groups(workload.name, params, world_size, seed))


def fewest_wire_bytes(group: GatheredGroup, group_size: int, element_bytes: int) -> float:
    """``T``: the bytes of every rank's rows of `group` in the spec's encoding, at least."""
    quantized = sum(numel for numel in group.numels if not spec.travels_exactly(numel))
    exact = sum(numel for numel in group.numels if spec.travels_exactly(numel))
    return quantized * spec.wire_bytes_per_element(group_size) + exact * element_bytes


def _fits(
    bucket: int, groups: Sequence[GatheredGroup], group_size: int, element_bytes: int
) -> bool:
    """Whether every gather within the bound of `bucket` needs CHUNK_TARGET collectives."""
    for group in groups:
        bound = staging.collective_bound(
            bucket=bucket,
            world_size=group.world_size,
            group_size=group_size,
            element_bytes=element_bytes,
            # The group's exact elements could all sit on one rank: the most one rank holds.
            rank_exact_numel=sum(n for n in group.numels if spec.travels_exactly(n)),
        )
        if CHUNK_TARGET * bound.bound_bytes > fewest_wire_bytes(group, group_size, element_bytes):
            return False
    return True


def edges_inside_parameters(group: GatheredGroup, bucket: int, group_size: int) -> bool:
    """Whether every chunk edge of the PR's chunking (``bucket // (W * G)`` groups per rank)
    of `group`'s flat buffer (parameters back to back, equal partitions) falls strictly
    inside a parameter."""
    per_rank = max(1, bucket // (group.world_size * group_size)) * group_size
    total = sum(group.numels)
    partition = -(-total // group.world_size)
    starts = [0, *itertools.accumulate(group.numels)][:-1]
    for rank in range(group.world_size):
        for edge in range(per_rank, partition, per_rank):
            position = rank * partition + edge
            if position >= total or starts[bisect.bisect_right(starts, position) - 1] == position:
                return False
    return True


def sized_bucket(
    groups: Sequence[GatheredGroup], group_size: int, element_bytes: int, world_size: int
) -> int:
    """[Note: the chunked arm]: the bucket, a multiple of ``world_size * group_size`` (at least
    one such unit, where even that does not fit)."""
    unit = world_size * group_size
    most = max(fewest_wire_bytes(group, group_size, element_bytes) for group in groups)
    low, high = 1, int(most // (element_bytes * unit)) + 1  # bound >= bucket * element_bytes
    while low < high:  # the largest multiple that fits: _fits is monotone in the bucket
        middle = (low + high + 1) // 2
        if _fits(middle * unit, groups, group_size, element_bytes):
            low = middle
        else:
            high = middle - 1
    for units in range(low, max(0, low - EDGE_TRIES), -1):
        if all(edges_inside_parameters(group, units * unit, group_size) for group in groups):
            return units * unit
    return low * unit


def chunked_bucket(
    workload: Any,
    *,
    world_size: int,
    seed: int,
    group_sizes: Sequence[int],
    dtype: str,
    allgather_bucket_size: int,
) -> int | None:
    """The chunked arm's bucket for a run ([Note: the chunked arm]); None where it gets no
    such arm: one rank (nothing is gathered), or a run whose own bucket already chunks."""
    if world_size < 2:
        return None
    groups = [
        group
        for group in gathered_groups(workload, world_size, seed)
        if group.world_size > 1 and group.numels
    ]
    if not groups:
        return None
    bucket = sized_bucket(groups, min(group_sizes), ELEMENT_BYTES[dtype], world_size)
    return bucket if allgather_bucket_size > bucket else None
