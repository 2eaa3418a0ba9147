"""qwz's bounded, quantized weight gather inside DeepSpeed's own ZeRO-1/2 optimizer.

DeepSpeed 0.19 accepts ``zero_quantized_weights: true`` at stages 1 and 2 and
does nothing with it, and its config schema rejects
``zero_quantized_weights_group_size``. :func:`initialize` is a drop-in for
``deepspeed.initialize`` that makes the setting real for the engine it returns::

    from qwz.integrations import deepspeed as qwz_deepspeed
    engine, optimizer, loader, scheduler = qwz_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config)

Supported: DeepSpeed >= 0.19, < 0.20 (:data:`SUPPORTED_DEEPSPEED`), stages 1
and 2, bf16, fp16 (with DeepSpeed's loss scaling: an overflow step skips the
gather as stock does) and fp32 weights, on the dp process group DeepSpeed
picks for each param group (tested where that group is the whole world).

[Note: what is replaced]
DeepSpeed's ``DeepSpeedZeroOptimizer.step`` steps the fp32 master partition,
copies it into this rank's slice of the flat bit16 buffer and then calls the
module-level ``all_gather_dp_groups(groups_flat=self.bit16_groups_flat,
partitioned_param_groups=self.parallel_partitioned_bit16_groups, ...)``,
which all-gathers every rank's slice in the working dtype.
``update_lp_params`` (used after a universal-checkpoint load) does the same.
qwz replaces exactly that gather and nothing else:

* Two *bound methods of the one optimizer object* that ``deepspeed.initialize``
  built are replaced, ``step`` and ``update_lp_params``. Each runs DeepSpeed's
  own class method unchanged, inside a scope where the name
  ``all_gather_dp_groups`` of ``deepspeed.runtime.zero.stage_1_and_2``
  resolves to a dispatcher. The dispatcher runs qwz's gather only when it is
  handed *this* optimizer's own buffers (checked by identity) and otherwise
  calls DeepSpeed's function; the module name is restored when the call
  returns, even on error. So every other engine in the process, built by a
  plain ``deepspeed.initialize`` before or after, stays stock, and this
  engine's gradient reduction, norm, clipping, loss scaling, overflow skip and
  optimizer step are DeepSpeed's own code. (The scope is process-global for
  the duration of one ``step``: two engines stepping in two threads at once
  are not supported, and DeepSpeed does not support that either.)
* A step that should have gathered but did not reach the dispatcher (a
  DeepSpeed change) raises instead of silently training stock.
* ``quantization_group_size`` (the group size in force: G, or None when qwz
  does not gather), ``qwz_gather_stats`` (the last
  :class:`~qwz.collectives.GatherStats`, summed over groups and chunks) and
  ``qwz_gathers`` (how many qwz gathers ran) are set on the optimizer object.

Why it is safe: when the gather runs, the master partition has been stepped
and DeepSpeed has nothing left to do but refresh the parameter views, which
still point into ``bit16_groups_flat``. qwz writes that same buffer in place,
so its layout, its partitions, the parameter views and every later DeepSpeed
code path (checkpointing, ``zero_grad``, the next backward) see the usual
tensors with new values. The fp32 master is only read, never written.

[Note: gathering DeepSpeed's flat groups]
For every optimizer param group ``i``, with DeepSpeed's dp process group
``real_dp_process_group[i]`` of ``W`` ranks, the flat buffer holds ``W``
equal partitions of ``P`` elements (DeepSpeed pads the flat buffer to a
multiple of ``2 * W``; qwz never changes that layout). qwz gathers it with
:func:`qwz.collectives.gather_shards` twice:

1. *Quantized stream.* Each rank's source is its fp32 master partition
   (``single_partition_of_fp32_groups[i]``) zero-padded to ``P_pad`` =
   ``P`` rounded up to the group size ``G``, so a quantization group never
   spans two ranks; the padding exists only inside the gather and is dropped
   when the decoded values are written back. Elements of small parameters are
   zeroed in this source: they travel in the exact stream, and zeroing keeps
   a LayerNorm's weights out of its neighbours' scales. The stream is chunked
   by a :func:`qwz.layout.plan_chunks` plan over ``P_pad`` whose staging
   budget is ``allgather_bucket_size`` elements of the working dtype
   ([Note: staging bound], layout.py); each chunk is one ``gather_shards``
   call whose decoded ``(W, chunk)`` block is copied into every rank's
   partition of the flat buffer. Besides the staging, a chunk holds that
   decoded block (``W * chunk`` elements of the working dtype, at most
   ``element_size / (1 + 4/G)`` times the staging budget) and an fp32 copy of
   this rank's chunk of the master. The plan itself keeps every rank's
   small-parameter positions as int64: 8 bytes per small-parameter element
   of the model, on every rank.
2. *Exact stream.* Parameters of at most ``preserve_numel`` elements
   (``zero_quantized_weights_preserve_numel``, default 65,536) travel
   exactly, cast from the fp32 master to the working dtype as DeepSpeed
   casts them. qwz maps this onto DeepSpeed's flat groups by position: from
   DeepSpeed's parameter offsets (``round_robin_bit16_offsets``) it lists, for
   every rank, the positions of small-parameter elements inside that rank's
   partition (a parameter may straddle two partitions). Each rank packs its
   own such elements, the packed vectors (zero-padded to the longest) are
   gathered unquantized with the same staging budget, and every rank scatters
   each rank's packed values to that rank's positions. A group with no
   parameter above ``preserve_numel`` sends only this stream (the same bytes
   as stock), never a useless quantized one.

Every rank, the owner included, writes the decoded values of every partition,
so replicas are bit-identical after every step ([Note: replica consistency],
collectives.py). With one rank the same code runs with the collectives
skipped, as in qwz's own engine (stock DeepSpeed gathers nothing then).

Wire bytes per rank and step: ``P_pad * (1 + 4/G)`` plus the exact stream,
against ``2 * P`` for stock bf16 (``4 * P`` for fp32).

[Note: refused configurations]
When qwz would take over (stage 1 or 2, ``zero_quantized_weights: true``,
takeover enabled), :func:`initialize` raises :class:`qwz.ConfigError`, before
DeepSpeed builds anything, for:

* a DeepSpeed version outside :data:`SUPPORTED_DEEPSPEED`: the replaced
  gather is an internal of ``stage_1_and_2.py`` that may move in any release;
* ``offload_optimizer`` / ``offload_param`` with a device other than none
  (or the deprecated ``cpu_offload*`` flags): the master and the bit16
  partition then live on the host and are copied through a staging buffer
  this gather does not know;
* ZenFlow: its optimizer is a subclass with its own gather and step order;
* bf16 at stage 1 with ``data_types.grad_accum_dtype: fp32``: DeepSpeed then
  builds its ``BF16_Optimizer``, not the ZeRO optimizer;
* and after ``deepspeed.initialize``, any optimizer object that is not exactly
  ``DeepSpeedZeroOptimizer`` with the attributes the gather reads.

Always, whatever the stage: the qwz-owned keys are validated with qwz's rules
(:meth:`qwz.config.QuantizedWeights.from_section`: a group size is a positive
multiple of 8, only 64 with stage 3; ``zero_quantized_weights`` needs a
stage) and removed before DeepSpeed sees them, since its schema rejects them.
``zero_quantized_weights`` itself is removed when qwz takes over (so DeepSpeed
does not also act on it) and kept otherwise: stage 3 uses DeepSpeed's own
qwZ, and with the takeover disabled (``initialize(..., qwz_gather=False)`` or
``QWZ_DEEPSPEED_GATHER=0``) the request reaches stock DeepSpeed, which ignores
it -- the silent no-op that :func:`measure_weight_gather` detects. A
non-default ``preserve_numel`` with stage 3 is refused: only qwz honours it.

The detector's probe is :class:`qwz.probe.WireProbe`, which also sees the collectives
DeepSpeed cached at init (see [Note: probing DeepSpeed's collectives] in qwz/probe.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qwz.collectives import GatherStats, gather_shards
from qwz.config import (
    DEFAULT_PRESERVE_NUMEL,
    GROUP_SIZE_KEY,
    PRESERVE_KEY,
    QUANTIZED_WEIGHTS_KEY,
    ConfigError,
    QuantizedWeights,
    load_json_config,
    offload_enabled,
    parse_stage,
)
from qwz.integrations import deepspeed_shards
from qwz.layout import ChunkPlan, plan_chunks, quantized_unit_bytes
from qwz.probe import WireProbe
from qwz.quant import EAGER_KERNELS, QuantKernels, compiled_kernels

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))
"""DeepSpeed versions qwz takes over: at least the first, below the second (major, minor)."""

GATHER_ENV = "QWZ_DEEPSPEED_GATHER"
"""Set to 0 / false / off to keep stock DeepSpeed even when quantized weights are requested."""

_OPTIMIZER_ATTRIBUTES = (
    "bit16_groups_flat",
    "parallel_partitioned_bit16_groups",
    "single_partition_of_fp32_groups",
    "real_dp_process_group",
    "round_robin_bit16_meta",
    "round_robin_bit16_offsets",
    "allgather_bucket_size",
    "cpu_offload",
    "overflow",
)
"""What the gather reads from DeepSpeedZeroOptimizer; a build without one of them is refused."""


# --------------------------------------------------------------------------- #
# initialize
# --------------------------------------------------------------------------- #


def initialize(
    *args: Any, qwz_gather: bool | None = None, compile_kernels: bool = False, **kwargs: Any
) -> tuple:
    """``deepspeed.initialize`` with ``zero_quantized_weights`` made real at stages 1 and 2.

    Same arguments and return value ``(engine, optimizer, dataloader, lr_scheduler)``;
    the config may be given as ``config``, ``config_params`` or ``args.deepspeed_config``
    (a dict, a JSON path or JSON text). ``qwz_gather=False`` (default: the
    ``QWZ_DEEPSPEED_GATHER`` environment variable, on unless 0/false/off) validates
    and strips the qwz keys but leaves DeepSpeed stock. ``compile_kernels`` fuses the
    quantize/dequantize kernels with ``torch.compile``. See the module docstring.
    """
    import deepspeed

    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    config = _take_config(bound.arguments)
    if config is None:  # DeepSpeed reports the missing config its own way
        return deepspeed.initialize(*bound.args, **bound.kwargs)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization: {zero!r} is invalid: must be a JSON object")
    zero = dict(zero)
    stage = parse_stage(zero)
    requested = QuantizedWeights.from_section(zero, stage)
    take_over = requested.enabled and stage in (1, 2) and _gather_enabled(qwz_gather)
    if stage == 3 and requested.preserve_numel != DEFAULT_PRESERVE_NUMEL:
        raise ConfigError(
            f"zero_optimization.{PRESERVE_KEY}: {requested.preserve_numel!r} is invalid: "
            "only qwz's stage 1/2 gather honours it; stage 3 uses DeepSpeed's own qwZ"
        )
    if take_over:
        _check_supported(deepspeed.__version__, config, zero, stage)
    for key in (GROUP_SIZE_KEY, PRESERVE_KEY) + ((QUANTIZED_WEIGHTS_KEY,) if take_over else ()):
        zero.pop(key, None)
    if "zero_optimization" in config:
        config["zero_optimization"] = zero
    bound.arguments["config"] = config

    result = deepspeed.initialize(*bound.args, **bound.kwargs)
    optimizer = result[0].optimizer
    if stage in (1, 2) and _is_zero_optimizer(optimizer):
        deepspeed_shards.attach(optimizer)
    if take_over:
        _take_over(optimizer, requested)
        if compile_kernels:
            optimizer.qwz_kernels = compiled_kernels()
    elif stage in (1, 2) and _is_zero_optimizer(optimizer):
        optimizer.quantization_group_size = None
        optimizer.qwz_gather_stats = None
        optimizer.qwz_gathers = 0
    return result


def _take_config(arguments: dict[str, Any]) -> dict[str, Any] | None:
    """The config dict from wherever deepspeed.initialize would read it, ready to edit."""
    config = arguments.pop("config", None)
    legacy = arguments.pop("config_params", None)
    if config is None:
        config = legacy
    args = arguments.get("args")
    for attribute in ("deepspeed_config", "deepscale_config"):
        from_args = getattr(args, attribute, None)
        if from_args is not None and config is None:
            # The caller's namespace is left untouched: DeepSpeed gets a copy without it.
            args = copy.copy(args)
            setattr(args, attribute, None)
            arguments["args"] = args
            config = from_args
    if config is None:
        return None
    return copy.deepcopy(load_json_config(config))


def _gather_enabled(qwz_gather: bool | None) -> bool:
    if qwz_gather is not None:
        return bool(qwz_gather)
    return os.environ.get(GATHER_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; (-1, -1) when it does not start with them."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (-1, -1)


def _check_supported(
    version: str, config: Mapping[str, Any], zero: Mapping[str, Any], stage: int
) -> None:
    """[Note: refused configurations] that can be seen in the config."""
    low, high = SUPPORTED_DEEPSPEED
    if not low <= _version_tuple(version) < high:
        raise ConfigError(
            f"deepspeed: version {version!r} is not supported by qwz.integrations.deepspeed "
            f"(supported: >={low[0]}.{low[1]}, <{high[0]}.{high[1]}); the replaced gather is "
            "an internal of deepspeed/runtime/zero/stage_1_and_2.py"
        )
    prefix = "zero_optimization."
    for key in ("offload_optimizer", "offload_param"):
        if offload_enabled(zero.get(key)):
            raise ConfigError(
                f"{prefix}{key}: {zero[key]!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
                "(offload keeps the master and the bit16 partition on the host; use device none)"
            )
    for key in ("cpu_offload", "cpu_offload_param"):
        if zero.get(key):
            raise ConfigError(
                f"{prefix}{key}: {zero[key]!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
                "(offload is not supported; set false)"
            )
    zenflow = zero.get("zenflow")
    if (
        zenflow is not None
        and zenflow is not False
        and not (isinstance(zenflow, Mapping) and zenflow.get("enabled") is False)
    ):
        raise ConfigError(
            f"{prefix}zenflow: {zenflow!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
            "(ZenFlow's optimizer has its own gather and step order)"
        )
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    grad_accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 1 and isinstance(bf16, Mapping) and bf16.get("enabled") and grad_accum == "fp32":
        raise ConfigError(
            f"data_types.grad_accum_dtype: {grad_accum!r} is not supported with "
            f"{QUANTIZED_WEIGHTS_KEY} at stage 1 with bf16 (DeepSpeed then builds its "
            "BF16_Optimizer, not the ZeRO optimizer qwz extends); remove it or use stage 2"
        )


def _is_zero_optimizer(optimizer: Any) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return type(optimizer) is DeepSpeedZeroOptimizer


# --------------------------------------------------------------------------- #
# The takeover
# --------------------------------------------------------------------------- #


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
    quantized_plan: ChunkPlan | None
    """Chunks of the zero-padded partition (P rounded up to G); None without large params."""
    exact_positions: tuple[torch.Tensor, ...]
    """Per rank: sorted int64 positions, inside that rank's partition, of small-parameter
    elements (on the flat buffer's device)."""
    own_exact_bounds: tuple[tuple[int, int], ...]
    """Per quantized chunk: [first, last) of this rank's exact positions inside the chunk."""
    exact_plan: ChunkPlan | None
    """Chunks of the packed exact stream (the longest rank's count); None when empty."""


def plan_flat_group(
    param_ranges: list[tuple[int, int]],
    partition_numel: int,
    *,
    rank: int,
    world_size: int,
    process_group: Any,
    group_size: int,
    preserve_numel: int,
    budget_bytes: int,
    element_size: int,
    device: torch.device | str = "cpu",
) -> FlatGroupPlan:
    """Plan one flat group from its parameters' ``(offset, numel)`` ranges in the flat buffer."""
    exact_ranges = sorted((start, n) for start, n in param_ranges if n <= preserve_numel)
    has_large = any(numel > preserve_numel for _, numel in param_ranges)
    exact_positions = []
    for owner in range(world_size):
        first, last = owner * partition_numel, (owner + 1) * partition_numel
        pieces = [
            torch.arange(max(start, first), min(start + numel, last), dtype=torch.int64) - first
            for start, numel in exact_ranges
            if start < last and start + numel > first
        ]
        exact_positions.append(torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64))
    quantized_plan, own_exact_bounds = None, ()
    if has_large:
        padded_partition = -(-partition_numel // group_size) * group_size
        quantized_plan = plan_chunks(
            padded_partition, world_size, group_size, quantized_unit_bytes(group_size), budget_bytes
        )
        starts = torch.tensor([start for start, _ in quantized_plan.chunks()] + [partition_numel])
        bounds = torch.searchsorted(exact_positions[rank], starts).tolist()
        own_exact_bounds = tuple(itertools.pairwise(bounds))
    longest_exact = max(positions.numel() for positions in exact_positions)
    exact_plan = None
    if longest_exact:
        exact_plan = plan_chunks(longest_exact, world_size, 1, element_size, budget_bytes)
    return FlatGroupPlan(
        process_group=process_group,
        rank=rank,
        world_size=world_size,
        partition_numel=partition_numel,
        quantized_plan=quantized_plan,
        exact_positions=tuple(positions.to(device) for positions in exact_positions),
        own_exact_bounds=own_exact_bounds,
        exact_plan=exact_plan,
    )


def _plan_optimizer(optimizer: Any, requested: QuantizedWeights) -> list[FlatGroupPlan]:
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
        ranges = [
            (int(offset), int(meta.numel()))
            for offset, meta in zip(
                optimizer.round_robin_bit16_offsets[i],
                optimizer.round_robin_bit16_meta[i],
                strict=True,
            )
        ]
        plans.append(
            plan_flat_group(
                ranges,
                partition_numel,
                rank=dist.get_rank(group=process_group),
                world_size=world_size,
                process_group=process_group,
                group_size=requested.group_size,
                preserve_numel=requested.preserve_numel,
                budget_bytes=int(optimizer.allgather_bucket_size) * flat.element_size(),
                element_size=flat.element_size(),
                device=flat.device,
            )
        )
    return plans


def _take_over(optimizer: Any, requested: QuantizedWeights) -> None:
    """Replace the weight gather of this one optimizer object; see [Note: what is replaced]."""
    if not _is_zero_optimizer(optimizer):
        raise ConfigError(
            f"zero_optimization.{QUANTIZED_WEIGHTS_KEY}: True is not supported with "
            f"{type(optimizer).__name__}: qwz extends DeepSpeedZeroOptimizer (ZeRO stages 1/2) only"
        )
    missing = [name for name in _OPTIMIZER_ATTRIBUTES if not hasattr(optimizer, name)]
    if missing:
        raise ConfigError(
            f"deepspeed: this build's DeepSpeedZeroOptimizer lacks {missing}, which "
            "qwz.integrations.deepspeed reads; it is not a supported DeepSpeed"
        )
    if optimizer.cpu_offload:
        raise ConfigError(
            f"zero_optimization.offload_optimizer: offload is not supported with "
            f"{QUANTIZED_WEIGHTS_KEY}"
        )
    optimizer.qwz_plans = _plan_optimizer(optimizer, requested)
    optimizer.quantization_group_size = requested.group_size
    optimizer.qwz_preserve_numel = requested.preserve_numel
    optimizer.qwz_gather_stats = None
    optimizer.qwz_gathers = 0
    optimizer.qwz_kernels = EAGER_KERNELS
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.update_lp_params = types.MethodType(_update_lp_params, optimizer)


def _step(self: Any, closure: Any = None) -> Any:
    """DeepSpeedZeroOptimizer.step with its weight gather done by qwz."""
    gathers_before = self.qwz_gathers
    with _gather_redirected(self):
        result = type(self).step(self, closure)
    if not self.overflow and self.qwz_gathers == gathers_before:
        raise RuntimeError(
            "qwz.integrations.deepspeed: DeepSpeed's step did not call all_gather_dp_groups, "
            "so qwz could not quantize the weight gather; this DeepSpeed is not supported"
        )
    return result


def _update_lp_params(self: Any) -> Any:
    """DeepSpeedZeroOptimizer.update_lp_params with its weight gather done by qwz."""
    with _gather_redirected(self):
        return type(self).update_lp_params(self)


@contextlib.contextmanager
def _gather_redirected(optimizer: Any) -> Iterator[None]:
    """Within the block, DeepSpeed's ``all_gather_dp_groups`` runs qwz's gather for this
    optimizer's own buffers and stays DeepSpeed's for anything else."""
    from deepspeed.runtime.zero import stage_1_and_2

    stock = stage_1_and_2.all_gather_dp_groups
    signature = inspect.signature(stock)

    def all_gather_dp_groups(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs).arguments
        if (
            call.get("groups_flat") is optimizer.bit16_groups_flat
            and call.get("partitioned_param_groups") is optimizer.parallel_partitioned_bit16_groups
        ):
            optimizer.qwz_gather_stats = gather_optimizer_weights(optimizer)
            optimizer.qwz_gathers += 1
            return None
        return stock(*args, **kwargs)

    stage_1_and_2.all_gather_dp_groups = all_gather_dp_groups
    try:
        yield
    finally:
        stage_1_and_2.all_gather_dp_groups = stock


# --------------------------------------------------------------------------- #
# The gather
# --------------------------------------------------------------------------- #


@torch.no_grad()
def gather_optimizer_weights(optimizer: Any) -> GatherStats:
    """Write every rank's master partition into every rank's flat bit16 buffer (all groups)."""
    total = GatherStats(0, 0, 0)
    for plan, flat, master in zip(
        optimizer.qwz_plans,
        optimizer.bit16_groups_flat,
        optimizer.single_partition_of_fp32_groups,
        strict=True,
    ):
        stats = gather_flat_group(plan, master.detach(), flat, kernels=optimizer.qwz_kernels)
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
) -> GatherStats:
    """Gather one flat group: the quantized stream, then the exact stream over it.

    master: (P,) this rank's fp32 master partition. flat: (W * P,) DeepSpeed's working
    buffer, written in place on every rank (the owner's own partition included).
    """
    world_size, partition_numel = plan.world_size, plan.partition_numel
    partitions = flat.view(world_size, partition_numel)  # (W, P), a view: writes land in flat
    stats: list[GatherStats] = []
    own_exact = plan.exact_positions[plan.rank]
    if plan.quantized_plan is not None:
        chunks = zip(plan.quantized_plan.chunks(), plan.own_exact_bounds, strict=True)
        for (start, end), (first, last) in chunks:
            chunk_numel = end - start
            real_end = min(end, partition_numel)  # beyond P: padding that exists only here
            source = torch.zeros(chunk_numel, dtype=master.dtype, device=master.device)
            source[: real_end - start].copy_(master[start:real_end])
            source[own_exact[first:last] - start] = 0  # they travel in the exact stream
            decoded = torch.empty(world_size, chunk_numel, dtype=flat.dtype, device=flat.device)
            stats.append(
                gather_shards(
                    source,
                    decoded.view(-1),
                    plan=dataclasses.replace(plan.quantized_plan, shard_numel=chunk_numel),
                    rank=plan.rank,
                    quantize=True,
                    group=plan.process_group,
                    kernels=kernels,
                )
            )
            partitions[:, start:real_end].copy_(decoded[:, : real_end - start])
    if plan.exact_plan is not None:
        own_values = master[own_exact]
        for start, end in plan.exact_plan.chunks():
            source = torch.zeros(end - start, dtype=master.dtype, device=master.device)
            own_chunk = own_values[start:end]
            source[: own_chunk.numel()].copy_(own_chunk)
            received = torch.empty(world_size, end - start, dtype=flat.dtype, device=flat.device)
            stats.append(
                gather_shards(
                    source,
                    received.view(-1),
                    plan=dataclasses.replace(plan.exact_plan, shard_numel=end - start),
                    rank=plan.rank,
                    quantize=False,
                    group=plan.process_group,
                )
            )
            for owner in range(world_size):
                positions = plan.exact_positions[owner][start:end]
                partitions[owner].index_copy_(0, positions, received[owner, : positions.numel()])
    return GatherStats(
        sum(s.collectives for s in stats),
        sum(s.bytes_sent for s in stats),
        max((s.peak_staging_bytes for s in stats), default=0),
    )


# --------------------------------------------------------------------------- #
# The silent-no-op detector
# --------------------------------------------------------------------------- #


class WeightGatherCheck(NamedTuple):
    """What one optimizer step gathered on this rank, against stock DeepSpeed."""

    gathered_bytes: int
    """Bytes this rank put into gather collectives during the step (seen on the wire)."""
    unquantized_bytes: int
    """Bytes stock DeepSpeed's gather puts in per step: this rank's partitions in the working
    dtype (0 when no group has more than one rank)."""
    qwz_gathers: int
    """qwz gathers the optimizer reports for the step (0 when qwz did not take over)."""
    largest_gather_output_bytes: int
    """Largest output buffer of one gather call during the step."""

    @property
    def ratio(self) -> float:
        """gathered / unquantized bytes (nan when nothing would be gathered)."""
        if not self.unquantized_bytes:
            return float("nan")
        return self.gathered_bytes / self.unquantized_bytes

    @property
    def in_effect(self) -> bool:
        """On the wire, fewer bytes than stock (but some) moved; with one rank, where
        nothing moves, qwz's own report of its gather decides."""
        if self.unquantized_bytes == 0:
            return self.qwz_gathers > 0
        return 0 < self.gathered_bytes < self.unquantized_bytes


def unquantized_gather_bytes(optimizer: Any) -> int:
    """Bytes this rank contributes to stock DeepSpeed's weight gather in one step."""
    if not hasattr(optimizer, "parallel_partitioned_bit16_groups"):
        raise TypeError(
            f"{type(optimizer).__name__}: the weight-gather check reads DeepSpeed's ZeRO-1/2 "
            "optimizer (stage 3 gathers in forward, not in step)"
        )
    total = 0
    for i, partitions in enumerate(optimizer.parallel_partitioned_bit16_groups):
        if dist.get_world_size(group=optimizer.real_dp_process_group[i]) > 1:
            rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
            total += partitions[rank].numel() * partitions[rank].element_size()
    return total


def measure_weight_gather(engine: Any, step: Callable[[], Any] | None = None) -> WeightGatherCheck:
    """Run `step` (default ``engine.step()``, at an accumulation boundary, after backward)
    under a WireProbe and compare what was gathered with stock bytes."""
    optimizer = engine.optimizer
    gathers_before = getattr(optimizer, "qwz_gathers", 0)
    with WireProbe() as probe:
        (step or engine.step)()
    return WeightGatherCheck(
        gathered_bytes=probe.bytes["gather"],
        unquantized_bytes=unquantized_gather_bytes(optimizer),
        qwz_gathers=getattr(optimizer, "qwz_gathers", 0) - gathers_before,
        largest_gather_output_bytes=probe.largest_gather_output_bytes,
    )


def require_quantized_weights(check: WeightGatherCheck) -> WeightGatherCheck:
    """Raise unless `check` shows the quantized gather in effect; return it otherwise."""
    if not check.in_effect:
        raise RuntimeError(
            "quantized weights requested but not in effect: the step gathered "
            f"{check.gathered_bytes} bytes on this rank against {check.unquantized_bytes} "
            f"unquantized bytes (qwz gathers: {check.qwz_gathers})"
        )
    return check
