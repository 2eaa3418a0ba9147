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
  least ``CHUNK_TARGET`` (evidence/chunking.py, where this arithmetic lives, apart from what it
  judges) collectives per param group: the bytes its ranks' rows take in the
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

import functools
import json
from collections.abc import Sequence
from typing import Any

from qwz.qualify.evidence.chunking import GatheredGroup, sized_bucket
from qwz.qualify.run.workloads import Workload

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one element of each working dtype the plan knows."""


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
