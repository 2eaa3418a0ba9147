"""Graded, self-consistent bugs for the power table (benchmarks/power.py).

Each injector breaks a candidate arm *upstream of the optimizer* or in its state between
steps, so that the optimizer steps correctly on what it is handed and every exactness
check that takes the handed gradient and state as given still holds: the bug shows only
in what the arm learns -- which is what the power table measures. Every injector starts
after step 1 (step 1's masters still equal the reference's), on every rank alike.

* ``noise-<S>pct``: from step 2, every parameter's local gradient gets Gaussian noise of
  ``S`` percent of its own norm (seeded by seed, step, rank and parameter), before the reduction.
* ``late``: from step 2, every parameter's local gradient is replaced by the previous
  step's (the gradients arrive one step late).
* ``moments-lost``: once, after step ``steps // 2``, both Adam moments of every master are
  zeroed while the step count is kept (a restore that lost them).
* ``lr-<F>pct``: from step 2 the optimizer's learning rate is ``1 + F/100`` times the plan's.
  Not upstream of the optimizer: the exact update check computes AdamW with the plan's
  rate, so it is caught by ``update`` at any strength; the table shows that it is.

qwz never ships these: they live here, outside the package, and reach in through
``RunPlan.arm_hook`` as the mutation suite does (tests/multigpu/mutants.py).

Use: ``RunPlan(arm_hook="benchmarks.injectors:by_arm", ...)`` with the arms of
:class:`PowerPlan`, whose candidates are named ``candidate-g<G>-<injector>``; or a
single-candidate run with ``RunPlan.extra["injector"] = "<injector>"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwz.qualify.base.plan import ArmSpec, RunPlan

CORRECT = "correct"
"""The candidate without an injector."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _count_steps(engine) -> dict[str, int]:
    """A counter of `engine`'s training steps: ``counter["step"]`` is the step being
    trained (1-based) while its backward runs."""
    counter = {"step": 0}
    original = engine.train_step

    @functools.wraps(original)
    def train_step(loss):
        counter["step"] += 1
        return original(loss)

    engine.train_step = train_step
    return counter


def _after_step(engine, action: Callable[[int], None]) -> None:
    """Run `action(step)` after every training step of `engine`."""
    original = engine.train_step
    counter = {"step": 0}

    @functools.wraps(original)
    def train_step(loss):
        result = original(loss)
        counter["step"] += 1
        action(counter["step"])
        return result

    engine.train_step = train_step


def gradient_noise(engine, plan: RunPlan, strength: float) -> None:
    counter = _count_steps(engine)
    for index, param in enumerate(engine.module.parameters()):

        def noisy(grad, index=index):
            step = counter["step"]
            if step < 2:
                return grad
            seed = ((plan.seed * 100_003 + step) * 1_009 + _rank()) * 4_099 + index
            generator = torch.Generator().manual_seed(seed)
            noise = torch.randn(grad.shape, generator=generator, dtype=torch.float32)
            scale = strength * grad.float().norm() / noise.norm().clamp_min(1e-30)
            return grad + (noise.to(grad.device) * scale).to(grad.dtype)

        param.register_hook(noisy)


def gradients_late(engine, plan: RunPlan, strength: float) -> None:
    counter = _count_steps(engine)
    previous: dict[int, torch.Tensor] = {}
    for index, param in enumerate(engine.module.parameters()):

        def late(grad, index=index):
            stale = previous.get(index)
            previous[index] = grad.detach().clone()
            return grad if counter["step"] < 2 or stale is None else stale

        param.register_hook(late)


def moments_lost(engine, plan: RunPlan, strength: float) -> None:
    lost_after = max(1, plan.steps // 2)

    def lose(step: int) -> None:
        if step != lost_after:
            return
        with torch.no_grad():
            for state in engine.shard_optimizer.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key].zero_()

    _after_step(engine, lose)


def learning_rate_off(engine, plan: RunPlan, strength: float) -> None:
    def change(step: int) -> None:
        if step == 1:
            for group in engine.shard_optimizer.param_groups:
                group["lr"] = plan.lr * (1.0 + strength)

    _after_step(engine, change)


INJECTORS: dict[str, tuple[Callable[..., None], float]] = {
    "noise-1pct": (gradient_noise, 0.01),
    "noise-3pct": (gradient_noise, 0.03),
    "noise-10pct": (gradient_noise, 0.10),
    "noise-30pct": (gradient_noise, 0.30),
    "late": (gradients_late, 0.0),
    "moments-lost": (moments_lost, 0.0),
    "lr-2pct": (learning_rate_off, 0.02),
    "lr-5pct": (learning_rate_off, 0.05),
    "lr-20pct": (learning_rate_off, 0.20),
}
"""Injector name -> (function, strength), in the table's order."""


def inject(name: str, engine, plan: RunPlan) -> None:
    if name == CORRECT:
        return
    if name not in INJECTORS:
        raise ValueError(f"injector: {name!r} is unknown; choose one of {', '.join(INJECTORS)}")
    function, strength = INJECTORS[name]
    function(engine, plan, strength)


def arm_name(group_size: int, injector: str) -> str:
    return f"candidate-g{group_size}-{injector}"


def by_arm(arm: ArmSpec, engine, plan: RunPlan) -> None:
    """The ``RunPlan.arm_hook``: the injector the arm's name (or ``plan.extra``) names."""
    prefix = f"candidate-g{arm.group_size}-"
    name = arm.name.removeprefix(prefix) if arm.name.startswith(prefix) else None
    inject(name or plan.extra.get("injector", CORRECT), engine, plan)


@dataclass(frozen=True)
class PowerPlan(RunPlan):
    """A RunPlan whose candidates are one group size under several injectors: the
    reference and the calibration arm train once for all of them. Every check of a
    candidate depends only on that candidate, the reference and the calibration arm, so
    each candidate's checks are those a run of it alone derives (deterministic arms)."""

    injectors: tuple[str, ...] = (CORRECT,)

    @property
    def arms(self) -> list[ArmSpec]:
        shared = [arm for arm in super().arms if not arm.quantized]
        size = self.group_sizes[0]
        return shared + [ArmSpec(arm_name(size, name), True, size) for name in self.injectors]
