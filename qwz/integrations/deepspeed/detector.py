"""The silent-no-op detector: did a step's weight gather move fewer bytes than stock?

The detector's probe is :class:`qwz.integrations.probe.WireProbe`, which counts below every entry
point, the collectives DeepSpeed cached at init included (see [Note: wire accounting below every
entry point] in qwz/integrations/probe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

from qwz.integrations.deepspeed.state import state_of
from qwz.integrations.probe import WireProbe


class WeightGatherCheck(NamedTuple):
    """What one optimizer step gathered on this rank, against stock DeepSpeed."""

    gathered_bytes: int
    """Bytes this rank put into gather collectives during the step (seen on the wire)."""
    unquantized_bytes: int
    """Bytes stock DeepSpeed's gather puts in per step: this rank's partitions in the working
    dtype (0 when no group has more than one rank)."""
    qwz_gathers: int
    """qwz gathers the optimizer reports for the step (0 when qwz did not take over)."""
    largest_gather_output_bytes: int
    """Largest output buffer of one gather call during the step."""

    @property
    def ratio(self) -> float:
        """gathered / unquantized bytes (nan when nothing would be gathered)."""
        if not self.unquantized_bytes:
            return float("nan")
        return self.gathered_bytes / self.unquantized_bytes

    @property
    def in_effect(self) -> bool:
        """On the wire, fewer bytes than stock (but some) moved; with one rank, where
        nothing moves, qwz's own report of its gather decides."""
        if self.unquantized_bytes == 0:
            return self.qwz_gathers > 0
        return 0 < self.gathered_bytes < self.unquantized_bytes


def unquantized_gather_bytes(optimizer: Any) -> int:
    """Bytes this rank contributes to stock DeepSpeed's weight gather in one step."""
    if not hasattr(optimizer, "parallel_partitioned_bit16_groups"):
        raise TypeError(
            f"{type(optimizer).__name__}: the weight-gather check reads DeepSpeed's ZeRO-1/2 "
            "optimizer (stage 3 gathers in forward, not in step)"
        )
    total = 0
    for i, partitions in enumerate(optimizer.parallel_partitioned_bit16_groups):
        if dist.get_world_size(group=optimizer.real_dp_process_group[i]) > 1:
            rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
            total += partitions[rank].numel() * partitions[rank].element_size()
    return total


def _gathers(optimizer: Any) -> int:
    """How many qwz gathers ran on `optimizer` (0 for one qwz's initialize did not build)."""
    state = state_of(optimizer)
    return 0 if state is None else state.gathers


def measure_weight_gather(engine: Any, step: Callable[[], Any] | None = None) -> WeightGatherCheck:
    """Run `step` (default ``engine.step()``, at an accumulation boundary, after backward)
    under a WireProbe and compare what was gathered with stock bytes."""
    optimizer = engine.optimizer
    gathers_before = _gathers(optimizer)
    with WireProbe() as probe:
        (step or engine.step)()
    return WeightGatherCheck(
        gathered_bytes=probe.bytes["gather"],
        unquantized_bytes=unquantized_gather_bytes(optimizer),
        qwz_gathers=_gathers(optimizer) - gathers_before,
        largest_gather_output_bytes=probe.largest_gather_output_bytes,
    )


def require_quantized_weights(check: WeightGatherCheck) -> WeightGatherCheck:
    """Raise unless `check` shows the quantized gather in effect; return it otherwise."""
    if not check.in_effect:
        raise RuntimeError(
            "quantized weights requested but not in effect: the step gathered "
            f"{check.gathered_bytes} bytes on this rank against {check.unquantized_bytes} "
            f"unquantized bytes (qwz gathers: {check.qwz_gathers})"
        )
    return check
