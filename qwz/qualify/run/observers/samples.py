"""Sampled parameter values and their drift from the reference's: context only, never a
verdict (its bound holds for any two AdamW trajectories, qualify/evidence/checks.py) -- the
``drift_max_abs`` field of an arm's observation, and the samples the reference leaves for the
arms after it.
"""

from __future__ import annotations

from typing import Any

import torch

from qwz.qualify.run.observers.arm_observer import ArmObserver


class Samples(ArmObserver):
    """At each next use of the weights, the sampled elements of every parameter (`indices`;
    None: nothing sampled) and, given the reference's (`reference`), the largest absolute
    difference from them at the same step."""

    def __init__(
        self,
        module: torch.nn.Module,
        indices: dict[str, torch.Tensor] | None,
        reference: dict[str, list[torch.Tensor]] | None,
    ) -> None:
        self.module, self.indices, self.reference = module, indices, reference
        self.sampled: dict[str, list[torch.Tensor]] = {}
        self.drift_max_abs: list[float] = []

    def at_next_use(self, step: int, first_update_step: int | None) -> None:
        if self.indices is None:
            return
        params = dict(self.module.named_parameters())
        values = {
            name: params[name].detach().reshape(-1)[index.to(params[name].device)].float().cpu()
            for name, index in self.indices.items()
        }
        for name, value in values.items():
            self.sampled.setdefault(name, []).append(value)
        if self.reference is not None:
            self.drift_max_abs.append(
                max(
                    float((value - self.reference[name][step - 1]).abs().max())
                    for name, value in values.items()
                )
            )

    def report(self) -> dict[str, Any]:
        return {"drift_max_abs": self.drift_max_abs}
