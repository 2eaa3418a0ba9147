"""The chunked arm's bucket, from the contract's arithmetic alone: the spec's wire encoding
(spec.py) and the staging bound (staging.py), never an implementation's layout ([Note: the
chunked arm] in qualify/run/chunked_arm.py says why the arm exists; this module sizes it from
the param groups the run's workload hands its subject).

Like spec.py and staging.py, it imports nothing from the code it judges.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from qwz.qualify.evidence import spec, staging

CHUNK_TARGET = 16
"""Collectives per param group that any gather within the staging bound needs ([Note: the
chunked arm])."""
EDGE_TRIES = 16
"""Smaller buckets tried for one whose chunk edges all fall inside parameters."""


class GatheredGroup(NamedTuple):
    """One param group as its gather sees it."""

    numels: tuple[int, ...]
    """Its parameters' sizes, in the group's order (DeepSpeed flattens them so)."""
    world_size: int
    """The ranks its weights are gathered over (an expert group: the expert-data-parallel
    ranks, W / ep_size)."""


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
