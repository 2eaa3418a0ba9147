"""The same config gives the same training as DeepSpeed: optimizer hyperparameters
(DeepSpeed 0.19 ``runtime/engine.py`` ``_configure_basic_optimizer`` and
``get_optimizer_configuration``, ``ops/adam``) and the accumulation boundary
(``is_gradient_accumulation_boundary``). One test per behaviour; see [Note: DeepSpeed's
optimizer defaults] (qwz/optimizer.py)."""

from __future__ import annotations

import functools
import inspect
import types
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


HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


def deepspeed_builds(section: dict[str, Any], monkeypatch) -> tuple[str, dict[str, Any]]:
    """What DeepSpeed's own ``_configure_basic_optimizer`` builds for `section` on one GPU-less
    engine without offload: the class name and its hyperparameters, defaults applied. Where
    DeepSpeed constructs FusedAdam (whose kernels it would JIT-build), FusedAdam's signature
    is bound to the arguments DeepSpeed passes instead."""
    engine = pytest.importorskip("deepspeed.runtime.engine", reason="no deepspeed extra")
    from deepspeed.ops import adam
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, get_optimizer_params

    fused_adam_signature = inspect.signature(adam.FusedAdam)
    fused_adam_arguments: dict[str, Any] = {}

    def fused_adam(params: Any, **kwargs: Any) -> str:
        bound = fused_adam_signature.bind(params, **kwargs)
        bound.apply_defaults()
        fused_adam_arguments.update(bound.arguments)
        return "FusedAdam"

    monkeypatch.setattr(adam, "FusedAdam", fused_adam)
    name = section["type"]  # lower-cased as DeepSpeedConfig does
    name = name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name
    fake = types.SimpleNamespace(
        optimizer_name=lambda: name,
        optimizer_params=lambda: get_optimizer_params({"optimizer": section}),
        zero_use_cpu_optimizer=lambda: False,
    )
    fake.get_optimizer_configuration = functools.partial(
        engine.DeepSpeedEngine.get_optimizer_configuration, fake
    )
    optimizer = engine.DeepSpeedEngine._configure_basic_optimizer(
        fake, [torch.nn.Parameter(torch.zeros(2))]
    )
    if optimizer == "FusedAdam":
        return "FusedAdam", fused_adam_arguments
    return type(optimizer).__name__, optimizer.param_groups[0]


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: group[key] for key in HYPERPARAMETERS if key in group}


@pytest.mark.parametrize(
    "section",
    [
        {"type": "AdamW", "params": {}},
        {"type": "Adam", "params": {}},
        {"type": "AdamW"},
    ],
    ids=["AdamW", "Adam", "AdamW-no-params"],
)
def test_adam_without_lr_takes_fused_adams_defaults_as_deepspeed(section, monkeypatch):
    """DeepSpeed builds FusedAdam with nothing but adam_w_mode: lr, betas, eps and
    weight_decay are FusedAdam's defaults (1e-3, (0.9, 0.999), 1e-8, 0)."""
    cls, group = built(section)
    name, expected = deepspeed_builds(section, monkeypatch)
    assert (cls, name, expected["adam_w_mode"]) == (torch.optim.AdamW, "FusedAdam", True)
    assert hyperparameters(group) == hyperparameters(expected)
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.0


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_torch_adam_without_lr_takes_torchs_defaults_as_deepspeed(kind, monkeypatch):
    """With torch_adam DeepSpeed builds torch.optim.AdamW with no arguments: torch's lr and
    weight_decay defaults (1e-3 and 0.01)."""
    section = {"type": kind, "params": {"torch_adam": True}}
    cls, group = built(section)
    name, expected = deepspeed_builds(section, monkeypatch)
    assert (cls.__name__, name) == ("AdamW", "AdamW")
    assert hyperparameters(group) == hyperparameters(expected)


def test_sgd_without_lr_takes_torchs_default_as_deepspeed(monkeypatch):
    """DeepSpeed builds torch.optim.SGD(params) with no arguments, so torch's default lr
    (1e-3 since torch 2.2) applies, not an error."""
    section = {"type": "SGD", "params": {}}
    cls, group = built(section)
    name, expected = deepspeed_builds(section, monkeypatch)
    assert (cls, name) == (torch.optim.SGD, "SGD")
    assert hyperparameters(group) == hyperparameters(expected)
    assert group["lr"] == inspect.signature(torch.optim.SGD).parameters["lr"].default


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
