"""Engine and initialize(): forward, backward and step, DeepSpeed-style.

``qwz.initialize(model, config=ds_dict)`` validates the config, casts the model
to the working dtype, and wraps its trainable parameters in a
:class:`~qwz.optimizer.ZeroOptimizer`. The loop is the one DeepSpeed users write::

    engine = qwz.initialize(model, config=ds_config)
    for batch in batches:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()          # steps on every gradient_accumulation_steps-th call

The engine reads the config; the optimizer below it receives policies (qwz/policies.py).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from qwz import checkpoint, layout
from qwz.config import ConfigError, QwzConfig
from qwz.devices import group_device
from qwz.hashing import param_hash, tensors_hash
from qwz.loss_scale import LossScaler
from qwz.optimizer import WORKING_DTYPES, NonFiniteError, ZeroOptimizer
from qwz.policies import GatherPolicy, OptimizerSpec, ReducePolicy

_log = logging.getLogger(__name__)


class Engine:
    """A model plus its ZeRO-1/2 optimizer; see the module docstring.

    This class is longer than 150 lines because it is the engine's whole public face, the
    DeepSpeed engine's calls (forward, backward, step, the state dict) over one optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: QwzConfig,
        *,
        process_group: dist.ProcessGroup | None = None,
        fused_kernels: bool | None = None,
        shard_alignment: int | None = None,
        fused_norm: bool = False,
    ):
        _check_supported(config)
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(process_group) if distributed else 1
        _check_batch_sizes(config, world_size)
        # Checked against the config, not against what this world size quantizes, so an
        # alignment that one rank accepts is accepted by every world size.
        layout.resolve_shard_alignment(
            shard_alignment,
            group_size=config.zero.quantized_weights.group_size,
            quantize=config.zero.quantized_weights.enabled,
        )
        self.config = config
        self.world_size = world_size
        self.module = _place_module(model, config, process_group, distributed, world_size)
        assert config.optimizer is not None  # _check_supported
        self.optimizer = ZeroOptimizer(
            [(name, p) for name, p in self.module.named_parameters() if p.requires_grad],
            stage=config.zero.stage,
            optimizer=OptimizerSpec(config.optimizer.type, config.optimizer.params),
            gather=_gather_policy(config, world_size, shard_alignment, fused_kernels),
            reduce=_reduce_policy(config),
            gradient_clipping=config.gradient_clipping,
            process_group=process_group,
            fused_norm=fused_norm,
        )
        self._start_counters()

    def _start_counters(self) -> None:
        """The step counters, the last gradient norm and the loss scaler, before any step."""
        self.micro_steps = 0
        """step() calls so far (micro-batches), as DeepSpeed counts them."""
        self.global_steps = 0
        """Accumulation boundaries passed so far: optimizer steps, fp16 overflow skips
        included (as DeepSpeed counts them)."""
        self._grad_norm: torch.Tensor | float | None = None
        """The last optimizer step's gradient norm: on the device until
        :attr:`global_grad_norm` is read ([Note: host reads in a step], optimizer.py)."""
        self.skipped_steps = 0
        """Optimizer steps skipped because the fp16 gradients overflowed (as DeepSpeed counts)."""
        self.loss_scaler = (
            LossScaler.from_config(self.config.loss_scale)
            if self.config.dtype == "fp16"
            else LossScaler.unscaled()
        )
        """fp16 loss scaling ([Note: dynamic loss scale]); a fixed scale of 1 otherwise."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.auto_cast and self.config.dtype == "fp16":
            args, kwargs = _to_half(args), _to_half(kwargs)
        return self.module(*args, **kwargs)

    @property
    def global_grad_norm(self) -> float | None:
        """L2 norm of the rank-averaged gradient at the last optimizer step, before clipping
        (inf or nan when an fp16 overflow skipped it; DeepSpeed reports inf for both); None
        before the first step. Read from the device when asked, not by the step
        ([Note: host reads in a step], optimizer.py)."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    @global_grad_norm.setter
    def global_grad_norm(self, value: float | None) -> None:
        self._grad_norm = value

    @property
    def loss_scale(self) -> float:
        """The factor backward() multiplies the loss by (1 unless fp16)."""
        return self.loss_scaler.scale

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last of its accumulation window, so
        that this micro-batch's step() updates the weights.

        As in DeepSpeed, ``micro_steps`` counts step() calls, so the answer is the same
        before and after this micro-batch's backward, and True on the last micro-batch."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` scaled by 1 / gradient_accumulation_steps (and, in fp16, by
        the loss scale, in fp32), then hand the gradients to the optimizer (stage 2
        reduce-scatters them right away)."""
        loss = loss / self.config.gradient_accumulation_steps
        if self.config.dtype == "fp16":
            loss = loss.float() * self.loss_scaler.scale
        loss.backward()
        self.optimizer.accumulate_gradients()

    def step(self) -> bool:
        """End this micro-batch; at the accumulation boundary take the optimizer step.
        Returns whether the weights were updated. Call it once per micro-batch, after
        backward, as with DeepSpeed."""
        boundary = self.is_gradient_accumulation_boundary()
        stepped = False
        if boundary:
            stepped = self._optimizer_step()
            self.global_steps += 1
        self.micro_steps += 1
        return stepped

    def _optimizer_step(self) -> bool:
        """One optimizer step with fp16 overflow handling; True when the weights changed."""
        step_index = self.global_steps + 1
        fp16 = self.config.dtype == "fp16"
        scaler = self.loss_scaler
        at_floor = fp16 and scaler.at_floor
        try:
            outcome = self.optimizer.step(
                step_index, loss_scale=scaler.scale, skip_overflow=fp16 and not at_floor
            )
        except NonFiniteError as error:
            if not (at_floor and error.what == "gradient"):
                raise
            error.args = (
                f"{error} (fp16: the loss scale {scaler.scale:g} is already at "
                f"fp16.min_loss_scale, so the overflow cannot be skipped)",
            )
            raise
        self._grad_norm = outcome.grad_norm
        # Only an fp16 overflow skips a step (any other non-finite gradient raised), so the
        # host knows without reading the norm.
        overflow = not outcome.stepped
        scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if self.optimizer.rank == 0:
                _log.warning(
                    "step %d: fp16 gradients overflowed; skipped the step on every rank "
                    "(loss scale now %g)",
                    step_index,
                    scaler.scale,
                )
        return not overflow

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> pathlib.Path:
        """Write this rank's fp32 master shards, optimizer state, step counters and module
        state not owned by the optimizer, plus a manifest; call on every rank, at an
        accumulation boundary. See [Note: checkpoint layout] (checkpoint.py)."""
        optimizer = self.optimizer
        return checkpoint.save(
            self._checkpoint_target(),
            directory,
            summary={
                "quantization_group_size": optimizer.quantization_group_size,
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "param_hash": param_hash(self.module),
            },
            rank_summary={"masters_hash": tensors_hash(optimizer.master_shards().items())},
        )

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore everything save_checkpoint wrote, all or nothing, and re-gather the working
        weights from the restored masters; call on every rank. Raises CheckpointError (nothing
        loaded) for a damaged checkpoint or one of another layout. Returns the manifest."""
        return checkpoint.load(self._checkpoint_target(), directory)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the optimizer's (fp32 master shards and torch optimizer state),
        the module state the optimizer does not own (frozen parameters and buffers), and the
        counters and loss scale. Raises RuntimeError inside an accumulation window (its
        pending gradients are not part of the state)."""
        window = self.config.gradient_accumulation_steps
        if self.micro_steps % window:
            raise RuntimeError(
                f"save_checkpoint called after micro-batch {self.micro_steps % window} of "
                f"{window} of an accumulation window; the pending gradients are not part of a "
                "checkpoint: save after the window's step()"
            )
        return {
            "optimizer": self.optimizer.state_dict(),
            "module_extras": self._module_extras(),
            "engine": {
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps,
                "global_grad_norm": self.global_grad_norm,
                "loss_scale": self.loss_scaler.state_dict(),
            },
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ValueError naming the first part of `state` that does not fit this engine;
        changes nothing."""
        try:
            self.optimizer.check_state_dict(state["optimizer"])
        except (ValueError, KeyError) as error:
            raise ValueError(f"optimizer state does not fit: {error}") from None
        here, saved = self._module_extras(), state["module_extras"]
        if saved.keys() != here.keys():
            missing, extra = sorted(here.keys() - saved.keys()), sorted(saved.keys() - here.keys())
            raise ValueError(
                f"frozen parameters and buffers differ: missing {missing}, unexpected {extra}"
            )
        for name, tensor in here.items():
            value = saved[name]
            if value.dtype != tensor.dtype or value.shape != tensor.shape:
                raise ValueError(
                    f"{name} is {value.dtype} {tuple(value.shape)} in the checkpoint, "
                    f"{tensor.dtype} {tuple(tensor.shape)} in this model"
                )
        self.loss_scaler.check_state_dict(state["engine"].get("loss_scale"))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly and re-gather the working weights from the
        restored masters ([Note: resume from the masters], checkpoint.py). Checks everything
        (:meth:`check_state_dict`) before changing anything."""
        self.check_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
        named = {f"param:{n}": p for n, p in self.module.named_parameters() if not p.requires_grad}
        named.update({f"buffer:{n}": b for n, b in self.module.named_buffers()})
        for name, value in state["module_extras"].items():
            named[name].copy_(value)
        counters = state["engine"]
        self.global_steps = counters["global_steps"]
        self.micro_steps = counters["micro_steps"]
        self.skipped_steps = counters["skipped_steps"]
        self.global_grad_norm = counters["global_grad_norm"]
        self.loss_scaler.load_state_dict(counters["loss_scale"])

    def _module_extras(self) -> dict[str, torch.Tensor]:
        """The module state the optimizer does not own: frozen parameters and buffers."""
        extras = {
            f"param:{name}": param.detach().clone()
            for name, param in self.module.named_parameters()
            if not param.requires_grad
        }
        extras.update(
            {
                f"buffer:{name}": buffer.detach().clone()
                for name, buffer in self.module.named_buffers()
            }
        )
        return extras

    def _checkpoint_target(self) -> checkpoint.Target:
        """This engine as a checkpoint target ([Note: checkpoint target], checkpoint.py)."""
        config, optimizer = self.config, self.optimizer
        return checkpoint.Target(
            state=self,
            layout={
                "world_size": self.world_size,
                "stage": config.stage,
                "dtype": config.dtype,
                "group_size": config.group_size,
                "quantized_weights": config.quantized_weights,
                "preserve_numel": config.zero.quantized_weights.preserve_numel,
            },
            group=checkpoint.Group(optimizer.process_group, optimizer.world_size, optimizer.rank),
        )


@torch.no_grad()
def broadcast_module_state(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None
) -> None:
    """Make every parameter (trainable or frozen) and every buffer group rank 0's, exactly.

    [Note: replicas start identical]
    Ranks may build their models from different seeds. The optimizer only ever sees the
    trainable parameters, so frozen ones (a LoRA base) and buffers (BatchNorm statistics)
    would otherwise stay different on every rank for the whole run, as would the forward
    pass built on them. Like DeepSpeed at initialisation, the engine broadcasts the whole
    module state from group rank 0 once; the optimizer's own broadcast of its flat buffers
    then changes nothing."""
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    tensors = [param.data for param in module.parameters()] + list(module.buffers())
    for tensor in tensors:
        if tensor.is_contiguous():
            dist.broadcast(tensor, src=source, group=process_group)
        else:
            staged = tensor.contiguous()
            dist.broadcast(staged, src=source, group=process_group)
            tensor.copy_(staged)


def _place_module(
    model: torch.nn.Module,
    config: QwzConfig,
    process_group: dist.ProcessGroup | None,
    distributed: bool,
    world_size: int,
) -> torch.nn.Module:
    """`model` in the working dtype, on the group's device (`distributed`: a process group is
    initialised), with rank 0's state on every rank.

    [Note: collectives on the group's device] (devices.py): cuda:LOCAL_RANK for an NCCL or
    mixed "cpu:gloo,cuda:nccl" group, set as the current device; one move, already in the
    working dtype, so the GPU never holds an fp32 copy of the model."""
    device = group_device(process_group) if distributed else None
    if device is not None and device.type != "cuda":
        device = None  # a gloo group: the model stays where the caller put it
    module = model.to(device=device, dtype=WORKING_DTYPES[config.dtype])
    if distributed and world_size > 1:  # [Note: replicas start identical]
        broadcast_module_state(module, process_group)
    return module


def _reduce_policy(config: QwzConfig) -> ReducePolicy:
    """The gradient reduction `config` asks for. DeepSpeed's ZeRO-1/2 reduces in
    `communication_data_type`, else the working dtype: the same bytes for the same config."""
    return ReducePolicy(
        bucket_size=config.zero.reduce_bucket_size,
        dtype=WORKING_DTYPES[config.communication_dtype or config.dtype],
        accumulate_dtype=WORKING_DTYPES[config.grad_accum_dtype or "fp32"],
    )


def _gather_policy(
    config: QwzConfig, world_size: int, shard_alignment: int | None, fused_kernels: bool | None
) -> GatherPolicy:
    """The weight gather `config` asks for at `world_size`.

    [Note: one rank gathers exactly]
    With one rank in the group there is nothing to send, so quantizing would only add int8
    error where no byte is saved (stock DeepSpeed gathers nothing there either): the working
    copy is the master cast to the working dtype, and quantization_group_size reports None."""
    weights = config.zero.quantized_weights
    return GatherPolicy(
        quantize=weights.enabled and world_size > 1,
        group_size=weights.group_size,
        preserve_numel=weights.preserve_numel,
        bucket_size=config.zero.allgather_bucket_size,
        shard_alignment=shard_alignment,
        fused_kernels=fused_kernels,
    )


def _to_half(value: Any) -> Any:
    """`value` with every floating-point tensor in it (through lists, tuples and dicts) cast
    to fp16, as DeepSpeed's `fp16.auto_cast` does for the positional inputs; qwz casts
    keyword inputs too (``engine(input_ids=..., pixel_values=...)``)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_to_half(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_half(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.half()
    return value


def _check_supported(config: QwzConfig) -> None:
    if config.stage not in (1, 2):
        what = "stage 3 engine" if config.stage == 3 else "stage 0 (plain data parallelism)"
        raise ConfigError(
            f"zero_optimization.stage: {config.stage} is not supported by qwz ({what}); "
            "qwz's engine implements ZeRO stages 1 and 2"
        )
    if config.optimizer is None:
        raise ConfigError(
            "optimizer: None is invalid: qwz builds the optimizer from the config; "
            'add {"type": "AdamW", "params": {"lr": ...}}'
        )


def _check_batch_sizes(config: QwzConfig, world_size: int) -> None:
    if config.train_batch_size is None or config.micro_batch_size is None:
        return
    expected = config.micro_batch_size * config.gradient_accumulation_steps * world_size
    if config.train_batch_size != expected:
        raise ConfigError(
            f"train_batch_size: {config.train_batch_size} is invalid: it must equal "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
            f"= {config.micro_batch_size} x {config.gradient_accumulation_steps} x "
            f"{world_size} = {expected}"
        )


def initialize(
    model: torch.nn.Module,
    config: Mapping[str, Any] | str | QwzConfig,
    *,
    process_group: dist.ProcessGroup | None = None,
    fused_kernels: bool | None = None,
    shard_alignment: int | None = None,
    fused_norm: bool = False,
) -> Engine:
    """Build an :class:`Engine` from a DeepSpeed-style config (dict, JSON path or JSON text).

    Uses the default process group unless `process_group` is given; without an
    initialised process group it runs on one rank with the collectives skipped.
    `fused_kernels`: None (default) uses the gather's fused kernels (qwz's native one-pass
    C kernels on CPU, ``torch.compile`` otherwise) when a one-time
    probe shows they work and write the eager kernels' bytes on every rank of the group, else
    uses the eager kernels on every rank (same bytes) and logs why
    (``engine.optimizer.kernel_fallback``, naming the ranks where they failed); True requires
    the fused kernels; False keeps eager.
    `shard_alignment`: None (default) pads the quantized region's shards to whole groups;
    a positive multiple of the group size pads them to whole multiples of it instead, so
    that engines of different group sizes share one layout and reduce their gradients in
    the same order ([Note: padding rule], layout.py). It is not a config key: it changes no
    training setting, only which rank owns which element, and DeepSpeed's strict config
    would refuse it.
    `fused_norm`: False (default) sums the gradient norm's squares with the eager kernel;
    True with one pass fused by ``torch.compile``, after a self-test on the device (raises if
    it fails); see [Note: the norm's kernel] (optimizer.py).
    """
    parsed = config if isinstance(config, QwzConfig) else QwzConfig.from_deepspeed(config)
    return Engine(
        model,
        parsed,
        process_group=process_group,
        fused_kernels=fused_kernels,
        shard_alignment=shard_alignment,
        fused_norm=fused_norm,
    )
