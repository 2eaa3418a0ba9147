"""The implementations a qualification can drive, behind one small interface.

``qwz``: qwz's own engine (``qwz.initialize``). ``deepspeed``: DeepSpeed's
ZeRO-1/2 engine, stock for the reference arm and with qwz's gather for the
candidate arms (``qwz.integrations.deepspeed.initialize``). Both expose the
same seam, [Note: own shards] (qwz/shards.py): ``optimizer.own_shards()`` and
``optimizer.shard_optimizer``. The harness uses that seam, the model's
parameters and the values below, never an engine's internals.
"""

from __future__ import annotations

from typing import Any

import torch

import qwz
from qwz.shards import OwnShard

SUBJECTS = ("qwz", "deepspeed")


class ArmEngine:
    """One trained configuration: ``train_step(loss)``, ``module``, ``grad_norm``,
    ``group_size`` (what the engine reports), and the seam: ``own_shards()`` and
    ``shard_optimizer``."""

    module: torch.nn.Module
    grad_norm: float | None
    group_size: int | None
    optimizer: Any

    def train_step(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def own_shards(self) -> list[OwnShard]:
        return self.optimizer.own_shards()

    @property
    def shard_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.shard_optimizer


class QwzArm(ArmEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        compile_kernels: bool,
        shard_alignment: int | None = None,
    ):
        self.engine = qwz.initialize(
            model, config=config, compile_kernels=compile_kernels, shard_alignment=shard_alignment
        )
        self.module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.group_size = self.optimizer.quantization_group_size
        self.grad_norm = None

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        self.grad_norm = self.engine.global_grad_norm


class DeepSpeedArm(ArmEngine):
    """DeepSpeed's engine; `qwz_gather` selects qwz's gather (candidates) or stock (reference)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        qwz_gather: bool,
        compile_kernels: bool,
    ):
        from qwz.integrations import deepspeed as integration

        self.engine, *_ = integration.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config,
            qwz_gather=qwz_gather,
            compile_kernels=compile_kernels,
        )
        self.module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.group_size = getattr(self.optimizer, "quantization_group_size", None)
        self.grad_norm = None

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.grad_norm = float(norm) if norm is not None else float("nan")


def make_arm(
    subject: str,
    model: torch.nn.Module,
    config: dict[str, Any],
    *,
    quantized: bool,
    compile_kernels: bool = False,
    integration_enabled: bool = True,
    shard_alignment: int | None = None,
) -> ArmEngine:
    """`shard_alignment`: qwz only ([Note: padding rule], qwz/layout.py); DeepSpeed
    partitions its own buffers and refuses the argument."""
    if subject == "qwz":
        return QwzArm(model, config, compile_kernels, shard_alignment)
    if shard_alignment is not None:
        raise ValueError(
            f"shard_alignment: {shard_alignment} is invalid for subject {subject!r}: only "
            "qwz's engine takes one (DeepSpeed partitions its own buffers)"
        )
    if subject == "deepspeed":
        return DeepSpeedArm(
            model,
            config,
            qwz_gather=quantized and integration_enabled,
            compile_kernels=compile_kernels,
        )
    raise ValueError(f"subject: {subject!r} is unknown; choose one of {', '.join(SUBJECTS)}")
