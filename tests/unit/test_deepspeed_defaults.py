"""The same config gives the same training as DeepSpeed: optimizer hyperparameters
(DeepSpeed 0.19 ``runtime/engine.py`` ``_configure_basic_optimizer`` and
``get_optimizer_configuration``, ``ops/adam``) and the accumulation boundary
(``is_gradient_accumulation_boundary``). One test per behaviour; see [Note: DeepSpeed's
optimizer defaults] (qwz/optimizer.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import qwz


def engine_with(section: dict[str, Any], accumulation: int = 1) -> qwz.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": accumulation,
        "optimizer": section,
    }
    return qwz.initialize(model, config=config)


def built(section: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    optimizer = engine_with(section).optimizer.shard_optimizer
    return type(optimizer), optimizer.param_groups[0]


def deepspeed_default(name: str, argument: str) -> Any:
    adam = pytest.importorskip("deepspeed.ops.adam", reason="the deepspeed extra is not installed")
    return inspect.signature(getattr(adam, name).__init__).parameters[argument].default


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_adam_without_weight_decay_takes_deepspeeds_default_not_torchs(kind):
    """DeepSpeed builds FusedAdam (DeepSpeedCPUAdam with offload), weight_decay default 0;
    torch.optim.AdamW's default is 0.01."""
    cls, group = built({"type": kind, "params": {"lr": 1e-3}})
    assert cls is torch.optim.AdamW
    assert group["weight_decay"] == deepspeed_default("FusedAdam", "weight_decay") == 0.0
    assert deepspeed_default("DeepSpeedCPUAdam", "weight_decay") == 0.0


def test_torch_adam_keeps_torchs_default_as_deepspeed_does():
    """With torch_adam DeepSpeed builds torch.optim.AdamW itself: torch's defaults apply."""
    cls, group = built({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    assert cls is torch.optim.AdamW
    assert (
        group["weight_decay"]
        == inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    )


@pytest.mark.parametrize(
    ("kind", "adam_w_mode", "expected"),
    [
        ("Adam", None, torch.optim.AdamW),  # ADAM_W_MODE_DEFAULT is True
        ("Adam", False, torch.optim.Adam),  # L2, as FusedAdam's mode 0
        ("AdamW", False, torch.optim.AdamW),  # "AdamW" forces decoupled decay
    ],
)
def test_adam_w_mode_as_deepspeed(kind, adam_w_mode, expected):
    params: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    cls, group = built({"type": kind, "params": params})
    assert cls is expected and group["weight_decay"] == 0.1


def test_sgd_is_torchs_with_the_given_arguments():
    cls, group = built({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    assert cls is torch.optim.SGD
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 0.0)
    assert (group["dampening"], group["nesterov"]) == (0.0, False)


def test_accumulation_boundary_is_the_last_micro_batch_before_and_after_backward():
    """DeepSpeed: (micro_steps + 1) % gradient_accumulation_steps == 0, micro_steps counting
    step() calls: False, False, True for a window of three, whether asked before or after
    backward, and step() updates the weights exactly on the True one."""
    engine = engine_with({"type": "AdamW", "params": {"lr": 1e-2}}, accumulation=3)
    before, after, stepped = [], [], []
    for micro in range(6):
        before.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(torch.full((2, 4), float(micro))).square().mean())
        after.append(engine.is_gradient_accumulation_boundary())
        stepped.append(engine.step())
    assert before == after == stepped == [False, False, True] * 2
    assert (engine.global_steps, engine.micro_steps) == (2, 6)
