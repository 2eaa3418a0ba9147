"""The implementations a qualification can drive, behind one small interface.

``qwz``: qwz's own engine (``qwz.initialize``). ``deepspeed``: DeepSpeed's
ZeRO-1/2 engine, stock for the reference arm and with qwz's gather for the
candidate arms (``qwz.integrations.deepspeed.initialize``). The harness uses
only what is here, never the engines' internals.
"""

from __future__ import annotations

from typing import Any

import torch

import qwz
from qwz.tolerance import own_shard_decode_ratio

SUBJECTS = ("qwz", "deepspeed")


class ArmEngine:
    """One trained configuration: `train_step(loss)`, `module`, `grad_norm`, `group_size`."""

    module: torch.nn.Module
    grad_norm: float | None
    group_size: int | None

    def train_step(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def element_scales(self, name: str) -> torch.Tensor:
        """Quantization scale of each element's group (an upper bound is allowed)."""
        raise NotImplementedError

    def own_shard_decode_ratio(self) -> float | None:
        """qwz.tolerance.own_shard_decode_ratio over this rank's own shard(s); None when the
        arm does not quantize."""
        raise NotImplementedError


class QwzArm(ArmEngine):
    def __init__(self, model: torch.nn.Module, config: dict[str, Any], compile_kernels: bool):
        self.engine = qwz.initialize(model, config=config, compile_kernels=compile_kernels)
        self.module = self.engine.module
        self.group_size = self.engine.optimizer.quantization_group_size
        self.grad_norm = None

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        self.grad_norm = self.engine.global_grad_norm

    def element_scales(self, name: str) -> torch.Tensor:
        return self.engine.optimizer.element_scales(name)

    def own_shard_decode_ratio(self) -> float | None:
        optimizer = self.engine.optimizer
        if not optimizer.quantize_weights:
            return None
        worst = 0.0
        for region in optimizer.regions:
            start, end = region.shard_range(optimizer.rank)
            exact = None if region.quantize else torch.ones(end - start, dtype=torch.bool)
            ratio = own_shard_decode_ratio(
                region.master, region.working[start:end], optimizer.group_size, exact
            )
            worst = max(worst, ratio)
        return worst


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
        self.group_size = getattr(self.engine.optimizer, "quantization_group_size", None)
        self.grad_norm = None
        self._quantized = bool(self.group_size)
        self._absmax, self._absmax_step = 0.0, -1

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.grad_norm = float(norm) if norm is not None else float("nan")

    def element_scales(self, name: str) -> torch.Tensor:
        # DeepSpeed's groups may span parameters, so bound each group's scale by the
        # largest magnitude of the whole working copy: absmax / 127 >= every group's scale.
        param = dict(self.module.named_parameters())[name]
        if not self._quantized:
            return torch.zeros(param.shape, device=param.device)
        if self._absmax_step != self.engine.global_steps:  # once per step, not per parameter
            self._absmax = max(float(p.detach().abs().max()) for p in self.module.parameters())
            self._absmax_step = self.engine.global_steps
        return torch.full(param.shape, self._absmax / 127, device=param.device)

    def own_shard_decode_ratio(self) -> float | None:
        optimizer = self.engine.optimizer
        plans = getattr(optimizer, "qwz_plans", None)
        if not self._quantized or plans is None:
            return None
        worst = 0.0
        for index, plan in enumerate(plans):
            master = optimizer.single_partition_of_fp32_groups[index]
            working = optimizer.parallel_partitioned_bit16_groups[index][plan.rank]
            exact = torch.zeros(plan.partition_numel, dtype=torch.bool, device=master.device)
            exact[plan.exact_positions[plan.rank].to(master.device)] = True
            ratio = own_shard_decode_ratio(master, working, self.group_size, exact)
            worst = max(worst, ratio)
        return worst


def make_arm(
    subject: str,
    model: torch.nn.Module,
    config: dict[str, Any],
    *,
    quantized: bool,
    compile_kernels: bool = False,
    integration_enabled: bool = True,
) -> ArmEngine:
    if subject == "qwz":
        return QwzArm(model, config, compile_kernels)
    if subject == "deepspeed":
        return DeepSpeedArm(
            model,
            config,
            qwz_gather=quantized and integration_enabled,
            compile_kernels=compile_kernels,
        )
    raise ValueError(f"subject: {subject!r} is unknown; choose one of {', '.join(SUBJECTS)}")
