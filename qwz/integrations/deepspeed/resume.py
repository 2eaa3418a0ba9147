"""Resume of a taken-over engine: the fp32 masters from the checkpoint's ZeRO files, or a refusal.

[Note: lossless resume]
With qwz's gather the working weights are the int8 decode of the fp32 masters,
so DeepSpeed's ``_restore_from_bit16_weights`` (masters := working weights,
``refresh_fp32_params`` calls it) would make the quantization error permanent
(see [Note: lossy resume] in takeover.py for where DeepSpeed calls it). DeepSpeed
reaches it from ``engine.load_checkpoint`` with ``load_module_only=True`` and with
``load_optimizer_states=False``, although the checkpoint directory holds every
rank's fp32 master partition in its ``zero_pp_rank_*`` files. The method is not
told which checkpoint is being loaded, so :func:`attach` replaces two bound
methods of the one engine object: ``load_checkpoint`` (which clears the record
below when it returns, even on error) and ``_load_checkpoint`` (DeepSpeed's
inner load, handed the directory and the resolved tag), which records
``optimizer.qwz.checkpoint_load = CheckpointLoad(engine, load_dir, tag)`` before it
runs DeepSpeed's own code.

The replaced ``_restore_from_bit16_weights`` / ``refresh_fp32_params``
(:func:`restore_masters`) then reads the ZeRO files with DeepSpeed's own reader
(``engine._get_all_zero_checkpoints``, the files a full load reads) and copies the
masters with DeepSpeed's own fp32 restore (``_load_legacy_checkpoint`` with
``load_optimizer_states=False, load_from_fp32_weights=True``, the copy a full load
makes), so they equal the saved masters bit for bit; the optimizer's loss scaler,
overflow flag and clip setting, which that method also loads, are put back, so
nothing but the masters differs from what stock DeepSpeed leaves. The optimizer
state (Adam's moments) is not loaded, as stock. The working weights are the
module's weights just loaded from the checkpoint, as after a full load.

It refuses (:class:`~qwz.integrations.deepspeed.takeover.LossyResumeError`, the
message as before plus the reason) where no usable fp32 master exists: outside a
``load_checkpoint`` (a direct call), with ``zero_optimization.load_from_fp32_weights:
false`` (the config asks for masters from the working weights, which is exactly
the lossy rebuild), for a universal checkpoint, when DeepSpeed finds no ZeRO
checkpoint or a rank's file is missing, and when the checkpoint's dp world size
differs from this one (its partitions are not this rank's). The ranks of the dp
group vote first (one ``all_reduce``), so either every rank restores or every rank
raises, and none waits in a collective the others never reach.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

_ENGINE_METHODS = (
    "load_checkpoint",
    "_load_checkpoint",
    "_get_all_zero_checkpoints",
    "zero_load_from_fp32_weights",
    "load_universal_checkpoint",
)
"""What :func:`attach` and :func:`restore_masters` use of DeepSpeedEngine."""

_RESTORED_STATE = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
"""Optimizer attributes ``_load_legacy_checkpoint`` loads besides the masters; kept as they were."""

_FULL_LOAD = (
    "engine.load_checkpoint(load_dir) with load_optimizer_states=True, load_module_only=False, "
    "zero_optimization.load_from_fp32_weights=true (the default) and every rank's "
    "zero_pp_rank_* file present"
)


class LossyResumeError(RuntimeError):
    """DeepSpeed was about to rebuild the fp32 masters from int8-quantized working weights
    and no fp32 master partition could be read instead ([Note: lossless resume])."""


def lossy_resume_message(optimizer: Any) -> str:
    return (
        "qwz.integrations.deepspeed: refusing to rebuild the fp32 master weights from the "
        f"int8-quantized working weights (group size {optimizer.quantization_group_size}): that "
        "would make the quantization error permanent. DeepSpeed does this when "
        "load_checkpoint runs with load_optimizer_states=False, with load_module_only=True, "
        "with zero_optimization.load_from_fp32_weights=false, or without the ZeRO "
        f"checkpoint files. Load fully instead: {_FULL_LOAD}. This engine may already hold "
        "the checkpoint's module weights with other masters: load again before training."
    )


class CheckpointLoad(NamedTuple):
    """The checkpoint an engine's ``load_checkpoint`` is reading, while it reads it."""

    engine: Any
    load_dir: str
    tag: str


def attach(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` tell its optimizer which checkpoint it loads; see
    [Note: lossless resume]."""
    missing = [name for name in _ENGINE_METHODS if not hasattr(engine, name)]
    if missing:
        from qwz.config import ConfigError

        raise ConfigError(
            f"deepspeed: this build's DeepSpeedEngine lacks {missing}, which "
            "qwz.integrations.deepspeed reads to resume; it is not a supported DeepSpeed"
        )
    optimizer = engine.optimizer
    stock_load = type(engine).load_checkpoint
    stock_inner = type(engine)._load_checkpoint
    inner_signature = inspect.signature(stock_inner)

    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return stock_load(self, *args, **kwargs)
        finally:
            optimizer.qwz.checkpoint_load = None

    def _load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = inner_signature.bind(self, *args, **kwargs).arguments
        optimizer.qwz.checkpoint_load = CheckpointLoad(self, call["load_dir"], call["tag"])
        return stock_inner(self, *args, **kwargs)

    optimizer.qwz.checkpoint_load = None
    engine.load_checkpoint = types.MethodType(load_checkpoint, engine)
    engine._load_checkpoint = types.MethodType(_load_checkpoint, engine)


def restore_masters(optimizer: Any) -> None:
    """Replaces ``_restore_from_bit16_weights`` and ``refresh_fp32_params`` of a taken-over
    optimizer: the masters from the checkpoint's fp32 partitions, or LossyResumeError."""
    load = optimizer.qwz.checkpoint_load
    zero_states, reason = _fp32_partitions(optimizer, load)
    process_group = optimizer.dp_process_group
    found = torch.tensor(
        [int(zero_states is not None)], device=optimizer.bit16_groups_flat[0].device
    )
    if dist.get_world_size(group=process_group) > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=process_group)
    if zero_states is None or not int(found):
        reason = reason or "another rank of the dp group found no fp32 master partition"
        raise LossyResumeError(f"{lossy_resume_message(optimizer)} (No fp32 masters: {reason}.)")
    kept = {name: getattr(optimizer, name) for name in _RESTORED_STATE}
    type(optimizer)._load_legacy_checkpoint(
        optimizer, zero_states, load_optimizer_states=False, load_from_fp32_weights=True
    )
    for name, value in kept.items():
        setattr(optimizer, name, value)


def _fp32_partitions(optimizer: Any, load: CheckpointLoad | None) -> tuple[list | None, str]:
    """DeepSpeed's ZeRO state dicts of `load` (this rank's filled in), or None and why not."""
    if load is None:
        return None, "not called from engine.load_checkpoint, so no checkpoint is known"
    engine = load.engine
    if not engine.zero_load_from_fp32_weights():
        return None, "zero_optimization.load_from_fp32_weights is false"
    if engine.load_universal_checkpoint():
        return None, "a universal checkpoint is restored by DeepSpeed's own universal load only"
    saved_world_size = getattr(engine, "loaded_checkpoint_dp_world_size", None)
    world_size = dist.get_world_size(group=optimizer.dp_process_group)
    if saved_world_size != world_size:
        return None, (
            f"the checkpoint was saved by {saved_world_size} dp ranks, this engine has "
            f"{world_size}, so its fp32 partitions are not this rank's"
        )
    try:
        zero_states = engine._get_all_zero_checkpoints(load.load_dir, load.tag)
    except FileNotFoundError as missing:
        return None, f"{missing.filename or missing} is missing"
    if zero_states is None:
        return None, f"DeepSpeed found no ZeRO checkpoint in {load.load_dir}/{load.tag}"
    return zero_states, ""
