"""DeepSpeed's own fp16 loss scaler, as the reference qwz's LossScaler is tested against.

``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` asks ``deepspeed.comm`` for the
rank only to decide whether to log an overflow, and ``deepspeed.comm`` refuses to answer
before ``deepspeed.init_distributed``. The tests give it a stand-in that answers with
torch.distributed's rank (or 1, so nothing is logged, without a process group); the
scaling rules themselves are DeepSpeed's code, unchanged.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from qwz.config import LossScaleConfig


def deepspeed_scaler(config: LossScaleConfig):
    """DeepSpeed's loss scaler for `config`, built as its ZeRO-1/2 optimizer builds it."""
    loss_scaler = pytest.importorskip(
        "deepspeed.runtime.fp16.loss_scaler",
        reason="the reference loss scaler is DeepSpeed's (pip install .[deepspeed])",
    )
    rank = dist.get_rank if dist.is_available() and dist.is_initialized() else lambda: 1
    loss_scaler.dist = types.SimpleNamespace(get_rank=rank)
    if not config.dynamic:
        return loss_scaler.LossScaler(scale=config.static_scale)
    return loss_scaler.DynamicLossScaler(
        init_scale=2**config.initial_scale_power,
        scale_window=config.window,
        min_scale=config.min_scale,
        delayed_shift=config.hysteresis,
        consecutive_hysteresis=config.consecutive_hysteresis,
    )


def step_masters(
    optimizer: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    model: torch.nn.Module,
    grads: list[torch.Tensor],
) -> None:
    """The reference's optimizer step: the fp32 masters take `grads`, and the fp16 model's
    parameters become the masters cast to fp16."""
    for master, grad in zip(masters, grads, strict=True):
        master.grad = grad
    optimizer.step()
    with torch.no_grad():
        for param, master in zip(model.parameters(), masters, strict=True):
            param.copy_(master)
