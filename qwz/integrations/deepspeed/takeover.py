"""The takeover: :func:`initialize` and the bound methods it replaces.

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
* Two more bound methods, ``_restore_from_bit16_weights`` and
  ``refresh_fp32_params``, restore the masters from the checkpoint's fp32
  partitions or refuse, and the engine's ``load_checkpoint`` and
  ``_load_checkpoint`` tell them which checkpoint is loading; see
  [Note: lossy resume] and [Note: lossless resume] (resume.py).
* A step that should have gathered but did not reach the dispatcher (a
  DeepSpeed change) raises instead of silently training stock.
* ``quantization_group_size`` (the group size in force: G, or None when qwz
  does not gather) and one :class:`~qwz.integrations.deepspeed.state.DropInState`,
  ``optimizer.qwz`` (the plans, the kernels, the last
  :class:`~qwz.collectives.GatherStats`, how many qwz gathers ran), are set on the
  optimizer object ([Note: drop-in state], state.py).

Why it is safe: when the gather runs, the master partition has been stepped
and DeepSpeed has nothing left to do but refresh the parameter views, which
still point into ``bit16_groups_flat``. qwz writes that same buffer in place,
so its layout, its partitions, the parameter views and every later DeepSpeed
code path (checkpointing, ``zero_grad``, the next backward) see the usual
tensors with new values. The fp32 master is only read, never written.

[Note: lossy resume]
With qwz's gather the working weights are the int8 decode of the masters, not
their rounding. DeepSpeed rebuilds the fp32 masters from the working weights in
one method, ``_restore_from_bit16_weights`` (``refresh_fp32_params`` calls it),
reached from ``engine.load_checkpoint`` with ``load_optimizer_states=False``,
with ``load_module_only=True``, with ``zero_optimization.load_from_fp32_weights:
false`` (in ``_load_legacy_checkpoint``), or when the ZeRO checkpoint is
missing. Done here it would make the quantization error permanent (every master
becomes its int8 decode, and elements below half their group's scale become exactly
0). On a
taken-over optimizer both methods are :func:`resume.restore_masters`: within a
``load_checkpoint`` whose directory holds every rank's fp32 master partition
(the first two ways) it copies those, bit for bit; everywhere else (the last two
ways, a direct call, a changed dp world size) it raises :class:`LossyResumeError`
naming the full load, which restores the masters from the checkpoint's fp32
copies bit for bit. DeepSpeed has already loaded the module's weights when it
gets there, so the engine is then half-loaded: the message says to load again.
To accept the int8 error deliberately, call the class method,
``DeepSpeedZeroOptimizer._restore_from_bit16_weights(optimizer)``. Every other
master write in DeepSpeed 0.19's stage 1/2 (the fp32 checkpoint restores, the
universal checkpoint) reads fp32 values.
"""

from __future__ import annotations

import contextlib
import inspect
import pathlib
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch.distributed as dist

from qwz.collectives import Staging, agree_on_kernels
from qwz.config import (
    DEFAULT_PRESERVE_NUMEL,
    GROUP_SIZE_KEY,
    PRESERVE_KEY,
    QUANTIZED_WEIGHTS_KEY,
    ConfigError,
    QuantizedWeights,
    parse_stage,
)
from qwz.integrations.deepspeed import resume, shards, structure
from qwz.integrations.deepspeed.config import check_supported, gather_enabled, take_config
from qwz.integrations.deepspeed.gather import gather_optimizer_weights, plan_optimizer
from qwz.integrations.deepspeed.state import DropInState
from qwz.kernels import choose_kernels

_OPTIMIZER_ATTRIBUTES = (
    *structure.NEEDED,
    "allgather_bucket_size",
    "cpu_offload",
    "overflow",
)
"""What the gather reads from DeepSpeedZeroOptimizer (the parameter offsets by capability,
[Note: reading DeepSpeed by capability] in structure.py); a build without one is refused."""


def initialize(
    *args: Any,
    qwz_gather: bool | None = None,
    fused_kernels: bool | None = None,
    **kwargs: Any,
) -> tuple:
    """``deepspeed.initialize`` with ``zero_quantized_weights`` made real at stages 1 and 2.

    Same arguments and return value ``(engine, optimizer, dataloader, lr_scheduler)``;
    the config may be given as ``config``, ``config_params`` or ``args.deepspeed_config``
    (a dict, a JSON path or JSON text). ``qwz_gather=False`` (default: the
    ``QWZ_DEEPSPEED_GATHER`` environment variable, on unless 0/false/off) validates
    and strips the qwz keys but leaves DeepSpeed stock. ``fused_kernels``: None
    (default) uses the gather's fused kernels (native C on CPU, ``torch.compile``
    otherwise) when a one-time probe shows they work here, else the eager
    kernels (same bytes), and logs why (``optimizer.qwz.kernel_fallback``); True requires
    the fused kernels; False keeps eager.
    """
    import deepspeed

    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    config = take_config(bound.arguments)
    if config is None:  # DeepSpeed reports the missing config its own way
        return deepspeed.initialize(*bound.args, **bound.kwargs)
    prepared = prepare_config(config, qwz_gather)
    bound.arguments["config"] = prepared.config

    result = deepspeed.initialize(*bound.args, **bound.kwargs)
    optimizer = result[0].optimizer
    stage = prepared.stage
    if stage in (1, 2) and _is_zero_optimizer(optimizer):
        shards.attach(optimizer)
    if prepared.take_over:
        _take_over(optimizer, prepared.requested, fused_kernels=fused_kernels)
        resume.attach(result[0])
    elif stage in (1, 2) and _is_zero_optimizer(optimizer):
        optimizer.quantization_group_size = None
        optimizer.qwz = DropInState()
    return result


class PreparedConfig(NamedTuple):
    """A config as :func:`initialize` hands it to DeepSpeed, and what qwz read from it."""

    config: dict[str, Any]
    """The config without the qwz-owned keys ([Note: refused configurations], config.py)."""
    requested: QuantizedWeights
    stage: int
    take_over: bool
    """Whether qwz's gather replaces DeepSpeed's (stage 1 or 2, requested, enabled)."""


def prepare_config(config: dict[str, Any], qwz_gather: bool | None = None) -> PreparedConfig:
    """The drop-in's config checks ([Note: refused configurations]), before DeepSpeed sees
    the config: qwz's rules for its keys, the refusals where qwz takes over, and the qwz-owned
    keys removed. ``config`` is edited in place; a ConfigError names what is refused."""
    import deepspeed

    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization: {zero!r} is invalid: must be a JSON object")
    zero = dict(zero)
    stage = parse_stage(zero)
    requested = QuantizedWeights.from_section(zero, stage)
    take_over = requested.enabled and stage in (1, 2) and gather_enabled(qwz_gather)
    if stage == 3 and requested.preserve_numel != DEFAULT_PRESERVE_NUMEL:
        raise ConfigError(
            f"zero_optimization.{PRESERVE_KEY}: {requested.preserve_numel!r} is invalid: "
            "only qwz's stage 1/2 gather honours it; stage 3 uses DeepSpeed's own qwZ"
        )
    if take_over:
        check_supported(installed_version(deepspeed), config, zero, stage)
    for key in (GROUP_SIZE_KEY, PRESERVE_KEY) + ((QUANTIZED_WEIGHTS_KEY,) if take_over else ()):
        zero.pop(key, None)
    if "zero_optimization" in config:
        config["zero_optimization"] = zero
    return PreparedConfig(config, requested, stage, take_over)


def installed_version(deepspeed: Any) -> str:
    """The imported DeepSpeed's real version ([Note: a checkout's real version], structure.py):
    a git checkout says "0.0.0" unless imported from its own root."""
    package = pathlib.Path(deepspeed.__file__).resolve().parent
    return structure.real_version(package, deepspeed.__version__)


def _is_zero_optimizer(optimizer: Any) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return type(optimizer) is DeepSpeedZeroOptimizer


def _take_over(
    optimizer: Any, requested: QuantizedWeights, fused_kernels: bool | None = None
) -> None:
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
    plans = plan_optimizer(optimizer, requested)
    # One-rank groups are copied exactly (gather.py); with only those, nothing is quantized.
    quantizing = any(plan.world_size > 1 for plan in plans)
    optimizer.quantization_group_size = requested.group_size if quantizing else None
    device = optimizer.bit16_groups_flat[0].device
    choice = choose_kernels(fused_kernels, device, optimizer.bit16_groups_flat[0].dtype)
    # Every rank takes over its optimizer, so the default group agrees for every gather group.
    choice = agree_on_kernels(choice, None, dist.get_world_size(), device)
    optimizer.qwz = DropInState(
        plans=plans,
        preserve_numel=requested.preserve_numel,
        kernels=choice.kernels,
        kernel_fallback=choice.fallback_reason,
        staging=Staging(device),
    )
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.update_lp_params = types.MethodType(_update_lp_params, optimizer)
    optimizer._restore_from_bit16_weights = types.MethodType(resume.restore_masters, optimizer)
    optimizer.refresh_fp32_params = types.MethodType(resume.restore_masters, optimizer)


def _step(self: Any, closure: Any = None) -> Any:
    """DeepSpeedZeroOptimizer.step with its weight gather done by qwz."""
    gathers_before = self.qwz.gathers
    with _gather_redirected(self):
        result = type(self).step(self, closure)
    if not self.overflow and self.qwz.gathers == gathers_before:
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
            optimizer.qwz.gather_stats = gather_optimizer_weights(optimizer)
            optimizer.qwz.gathers += 1
            return None
        return stock(*args, **kwargs)

    stage_1_and_2.all_gather_dp_groups = all_gather_dp_groups
    try:
        yield
    finally:
        stage_1_and_2.all_gather_dp_groups = stock
