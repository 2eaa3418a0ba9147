"""The gather over DeepSpeed's layout: plans for its flat bit16 groups and the gather itself.

[Note: gathering DeepSpeed's flat groups]
For every optimizer param group ``i``, with DeepSpeed's dp process group
``real_dp_process_group[i]`` of ``W`` ranks, the flat buffer holds ``W``
equal partitions of ``P`` elements (DeepSpeed pads the flat buffer to a
multiple of ``2 * W``; qwz never changes that layout). qwz gathers it with one
:func:`qwz.collectives.gather` (one collective per chunk, double-buffered,
[Note: gather pipeline]):

* *Quantized stream.* Each rank's source is its fp32 master partition
  (``single_partition_of_fp32_groups[i]``), quantized straight into the wire
  row in groups of ``G``; a partition that is not a whole number of groups has
  its last group zero-padded inside the kernel (so a group never spans two
  ranks), and the padding is never written back. Decoding writes straight into
  every rank's partition of ``bit16_groups_flat[i]``.
* *Exact runs, in the same rows.* Parameters of at most ``preserve_numel``
  elements (``zero_quantized_weights_preserve_numel``, default 65,536) travel
  exactly, cast from the fp32 master to the working dtype as DeepSpeed casts
  them ([Note: small parameters travel exactly], qwz/layout.py: why the drop-in
  keeps them in place while qwz's engine gives them a region). From DeepSpeed's
  parameter offsets ([Note: reading DeepSpeed by capability]) the plan keeps, for
  every rank, the exact runs ``[start, end)`` of exact elements inside its
  partition (a parameter may straddle two partitions):
  a few Python ints per small parameter, no per-element index. Each run travels
  in the row of the chunk that covers it, after that chunk's codes, and is
  written after that chunk's decode, so it overwrites the (meaningless) decoded
  values at its positions.
* *Masked groups.* A group holding both quantized and exact elements must not
  let the exact ones (a LayerNorm's weights of ~1) widen its scale: the plan
  lists these few groups per chunk (at most two per run) and the gather
  re-encodes them with the exact elements zeroed, right after the fused encode
  of the chunk (:class:`qwz.collectives.MaskedGroups`). The result is exactly
  ``quantize`` of the master with the exact elements zeroed.
* A group with no parameter above ``preserve_numel`` sends its partition in
  the working dtype through the same gather (the same bytes as stock), never a
  useless quantized stream.

Every rank, the owner included, writes the decoded values of every partition,
so replicas are bit-identical after every step ([Note: replica consistency],
collectives.py). A group of one rank is copied exactly from its master, as stock
DeepSpeed does and as qwz's own engine does (nothing to save on the wire).

Wire bytes per rank and step: ``P_pad * (1 + 4/G)`` plus the exact elements
(``P_pad``: ``P`` rounded up to ``G``) plus at most 3 bytes of row padding per
chunk, against ``2 * P`` for stock bf16 (``4 * P`` for fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qwz.collectives import GatherStats, MaskedGroups, Staging, gather
from qwz.config import ConfigError, QuantizedWeights
from qwz.integrations.deepspeed.structure import parameter_offsets
from qwz.kernels import EAGER_KERNELS, QuantKernels
from qwz.layout import GatherPlan, plan_gather


@dataclass(frozen=True)
class FlatGroupPlan:
    """How qwz gathers one of DeepSpeed's flat bit16 groups; see [Note: gathering
    DeepSpeed's flat groups]."""

    process_group: Any
    """DeepSpeed's dp process group for this param group (``real_dp_process_group[i]``)."""
    rank: int
    world_size: int
    partition_numel: int
    """DeepSpeed's partition size P (every rank's partition has this size)."""
    exact_runs: tuple[tuple[tuple[int, int], ...], ...]
    """Per rank: sorted, disjoint [start, end) runs of exact elements inside that rank's
    partition ([Note: small parameters travel exactly], qwz/layout.py)."""
    gather_plan: GatherPlan
    masked: tuple[MaskedGroups | None, ...]
    """Per chunk: this rank's groups that mix quantized and exact elements (or None)."""

    @property
    def quantized(self) -> bool:
        return self.gather_plan.quantize

    @property
    def exact_positions(self) -> tuple[torch.Tensor, ...]:
        """Per rank: sorted int64 positions of the exact elements inside that rank's
        partition (built on demand from the runs, on the CPU; for checks and reports)."""
        return tuple(
            torch.cat([torch.arange(start, end) for start, end in runs])
            if runs
            else torch.empty(0, dtype=torch.int64)
            for runs in self.exact_runs
        )


def _runs_per_owner(
    exact_ranges: Sequence[tuple[int, int]], partition_numel: int, world_size: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    runs = []
    for owner in range(world_size):
        first, last = owner * partition_numel, (owner + 1) * partition_numel
        owner_runs: list[tuple[int, int]] = []
        for start, numel in exact_ranges:
            low, high = max(start, first) - first, min(start + numel, last) - first
            if low >= high:
                continue
            if owner_runs and owner_runs[-1][1] == low:  # adjacent small parameters: one run
                owner_runs[-1] = (owner_runs[-1][0], high)
            else:
                owner_runs.append((low, high))
        runs.append(tuple(owner_runs))
    return tuple(runs)


def _masked_groups(
    plan: GatherPlan,
    own_runs: Sequence[tuple[int, int]],
    partition_numel: int,
    group_size: int,
    device: torch.device | str,
) -> tuple[MaskedGroups | None, ...]:
    """Per chunk, this rank's groups holding both quantized and exact real elements."""
    exact = set()
    for start, end in own_runs:
        exact.update({start // group_size, (end - 1) // group_size})
    masked = []
    for chunk in plan.chunks:
        first_group = chunk.start // group_size
        groups, elements, keeps = [], [], []
        for group in sorted(g for g in exact if chunk.start <= g * group_size < chunk.end):
            positions = range(group * group_size, (group + 1) * group_size)
            is_exact = [any(s <= p < e for s, e in own_runs) for p in positions]
            keep = [not x and p < partition_numel for p, x in zip(positions, is_exact, strict=True)]
            if any(keep) and any(is_exact):
                groups.append(group - first_group)
                elements.append([min(p, partition_numel - 1) for p in positions])
                keeps.append(keep)
        masked.append(
            MaskedGroups(
                torch.tensor(groups, dtype=torch.int64, device=device),
                torch.tensor(elements, dtype=torch.int64, device=device),
                torch.tensor(keeps, dtype=torch.bool, device=device),
            )
            if groups
            else None
        )
    return tuple(masked)


def plan_flat_group(
    param_ranges: list[tuple[int, int]],
    partition_numel: int,
    *,
    rank: int,
    world_size: int,
    process_group: Any,
    group_size: int,
    preserve_numel: int,
    bucket_bytes: int,
    element_size: int,
    device: torch.device | str = "cpu",
) -> FlatGroupPlan:
    """Plan one flat group from its parameters' ``(offset, numel)`` ranges in the flat buffer."""
    exact_ranges = sorted((start, n) for start, n in param_ranges if n <= preserve_numel)
    has_large = any(numel > preserve_numel for _, numel in param_ranges)
    runs = _runs_per_owner(exact_ranges, partition_numel, world_size)
    gather_plan = plan_gather(
        world_size=world_size,
        source_numel=partition_numel,
        quantize=has_large,
        group_size=group_size if has_large else None,
        element_size=element_size,
        bucket_bytes=bucket_bytes,
        exact_runs=runs if has_large else None,
    )
    masked = (
        _masked_groups(gather_plan, runs[rank], partition_numel, group_size, device)
        if has_large
        else (None,) * len(gather_plan.chunks)
    )
    return FlatGroupPlan(
        process_group=process_group,
        rank=rank,
        world_size=world_size,
        partition_numel=partition_numel,
        exact_runs=runs,
        gather_plan=gather_plan,
        masked=masked,
    )


def plan_optimizer(optimizer: Any, requested: QuantizedWeights) -> list[FlatGroupPlan]:
    """One :class:`FlatGroupPlan` per param group of DeepSpeed's ZeRO-1/2 optimizer; see
    [Note: gathering DeepSpeed's flat groups]."""
    plans = []
    for i, flat in enumerate(optimizer.bit16_groups_flat):
        partitions = optimizer.parallel_partitioned_bit16_groups[i]
        process_group = optimizer.real_dp_process_group[i]
        world_size = dist.get_world_size(group=process_group)
        partition_numel = partitions[0].numel()
        if (
            len(partitions) != world_size
            or any(p.numel() != partition_numel for p in partitions)
            or flat.numel() != world_size * partition_numel
            or not flat.is_contiguous()
        ):
            raise ConfigError(
                f"DeepSpeed param group {i}: partitions {[p.numel() for p in partitions]} of a "
                f"flat buffer of {flat.numel()} elements are not {world_size} equal, contiguous "
                "slices; qwz.integrations.deepspeed cannot gather this layout"
            )
        ranges = [(offset, numel) for _, offset, numel in parameter_offsets(optimizer, i)]
        plans.append(
            plan_flat_group(
                ranges,
                partition_numel,
                rank=dist.get_rank(group=process_group),
                world_size=world_size,
                process_group=process_group,
                group_size=requested.group_size,
                preserve_numel=requested.preserve_numel,
                bucket_bytes=int(optimizer.allgather_bucket_size) * flat.element_size(),
                element_size=flat.element_size(),
                device=flat.device,
            )
        )
    return plans


@torch.no_grad()
def gather_optimizer_weights(optimizer: Any) -> GatherStats:
    """Write every rank's master partition into every rank's flat bit16 buffer (all groups)."""
    state = optimizer.qwz  # [Note: drop-in state] (state.py)
    total = GatherStats(0, 0, 0)
    for plan, flat, master in zip(
        state.plans,
        optimizer.bit16_groups_flat,
        optimizer.single_partition_of_fp32_groups,
        strict=True,
    ):
        stats = gather_flat_group(
            plan,
            master.detach(),
            flat,
            kernels=state.kernels,
            staging=state.staging,
        )
        total = GatherStats(
            total.collectives + stats.collectives,
            total.bytes_sent + stats.bytes_sent,
            max(total.peak_staging_bytes, stats.peak_staging_bytes),
        )
    return total


@torch.no_grad()
def gather_flat_group(
    plan: FlatGroupPlan,
    master: torch.Tensor,
    flat: torch.Tensor,
    kernels: QuantKernels = EAGER_KERNELS,
    staging: Staging | None = None,
) -> GatherStats:
    """Gather one flat group: quantized rows with the exact runs in them, one collective per
    chunk. master: (P,) this rank's fp32 master partition. flat: (W * P,) DeepSpeed's working
    buffer, written in place on every rank (the owner's own partition included).

    A group of one rank is copied exactly, as stock DeepSpeed does: nothing travels, so
    quantizing would add int8 error and save no byte ([Note: one rank gathers exactly],
    qwz/engine.py)."""
    if plan.world_size == 1:
        flat.copy_(master)
        return GatherStats(0, 0, 0)
    return gather(
        plan.gather_plan,
        master,
        flat.view(plan.world_size, plan.partition_numel),  # a view: writes land in flat
        rank=plan.rank,
        staging=staging if staging is not None else Staging(flat.device),
        masked=plan.masked,
        group=plan.process_group,
        kernels=kernels,
    )
