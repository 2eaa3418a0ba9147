"""The replicas of an arm across ranks ([Note: replica sets], qualify/run/replicas.py): the
masters' digests after every step and in full after the first optimizer step ([Note:
layout-independent digests], digest.py), the first step whose working copies diverge, and the
final hashes -- the ``step_digests``, ``step1_digests``, ``replica_divergence``, ``final_hash``
and ``final_hashes`` fields of an arm's observation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qwz import shards as seam
from qwz.qualify.run import replicas
from qwz.qualify.run.observers.arm_observer import ArmObserver


class ReplicaWatch(ArmObserver):
    """The replica observer (every method a collective over the arm's ranks)."""

    def __init__(
        self,
        module: torch.nn.Module,
        shards: Sequence[seam.OwnShard],
        keys: dict[str, str],
        sets: replicas.ReplicaSets,
    ) -> None:
        self.module, self.shards, self.keys, self.sets = module, shards, keys, sets
        self.observed: dict[str, Any] = {"step_digests": []}

    def after_step(self, step: int, first_update_step: int | None) -> None:
        digests = replicas.master_digests(self.shards, self.sets)
        self.observed["step_digests"].append(replicas.short_digests(digests))
        if step == first_update_step and self.observed.get("step1_digests") is None:
            # The first optimizer step (step 1 unless fp16 overflows skipped the first):
            # until then no gather ran, so every arm held the same weights.
            self.observed["step1_digests"] = digests

    def at_next_use(self, step: int, first_update_step: int | None) -> None:
        divergent = replicas.divergence(self.module, self.sets)
        if divergent and self.observed.get("replica_divergence") is None:
            self.observed["replica_divergence"] = {"step": step, "parameters": divergent[:20]}

    def end(self) -> None:
        final = replicas.final_hashes(self.module, self.keys)
        self.observed["final_hash"], self.observed["final_hashes"] = final

    def report(self) -> dict[str, Any]:
        return dict(self.observed)
