"""The seam of [Note: own shards] (qwz/shards.py) over DeepSpeed's ZeRO-1/2 optimizer.

The same for a stock optimizer and one qwz took over. DeepSpeed keeps, per param
group ``i``, this rank's fp32 master partition (``single_partition_of_fp32_groups[i]``)
and the working copy of the same elements (``parallel_partitioned_bit16_groups[i][rank]``,
a slice of the flat bit16 buffer the parameters view), read by capability ([Note: reading
DeepSpeed by capability], structure.py: a DeepSpeed it cannot read raises SeamError). When
qwz's gather took over, a partition travels in groups of G elements starting at the
partition's first element, except the exact elements (the plan's exact runs, as
``exact_positions``; [Note: small parameters travel exactly], qwz/layout.py); stock DeepSpeed
sends the working dtype for everything.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from qwz.integrations.deepspeed.state import state_of
from qwz.integrations.deepspeed.structure import NEEDED, parameter_offsets, require
from qwz.shards import OwnShard, make_own_shard, slots_in_range


def own_shards(optimizer: Any) -> list[OwnShard]:
    """One OwnShard per DeepSpeed param group of `optimizer` (a DeepSpeedZeroOptimizer)."""
    require(optimizer, *NEEDED)
    state = state_of(optimizer)
    plans = None if state is None else state.plans
    group_size = optimizer.quantization_group_size if plans is not None else None
    names = getattr(optimizer, "param_names", None) or {}
    result = []
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        group = optimizer.real_dp_process_group[i]
        rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        partitions = optimizer.parallel_partitioned_bit16_groups[i]
        working = partitions[rank]
        partition_numel = working.numel()
        ranges = [
            (names.get(param, f"group{i}.param{index}"), offset, numel)
            for index, (param, offset, numel) in enumerate(parameter_offsets(optimizer, i))
        ]
        start = rank * partition_numel
        slots = slots_in_range(ranges, start, start + partition_numel)
        exact_mask, size = None, None
        if plans is not None and group_size and plans[i].world_size > 1:
            plan = plans[i]
            size = group_size
            exact_mask = torch.zeros(partition_numel, dtype=torch.bool, device=master.device)
            exact_mask[plan.exact_positions[plan.rank].to(master.device)] = True
        result.append(
            make_own_shard(f"group{i}", master, working.reshape(-1), size, exact_mask, slots)
        )
    return result


def attach(optimizer: Any) -> None:
    """Give `optimizer` the seam's methods: ``own_shards()`` and ``shard_optimizer``."""
    optimizer.own_shards = types.MethodType(own_shards, optimizer)
    optimizer.shard_optimizer = optimizer.optimizer
