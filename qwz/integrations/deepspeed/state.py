"""DropInState: everything qwz keeps on a DeepSpeed ZeRO-1/2 optimizer, in one object.

[Note: drop-in state]
:func:`~qwz.integrations.deepspeed.takeover.initialize` attaches one
:class:`DropInState` to the optimizer DeepSpeed built, as ``optimizer.qwz``, instead of
scattering attributes over DeepSpeed's object: a stock optimizer (takeover off) gets one
with no plans, so readers need not ask which kind they hold. Beside it, the optimizer keeps
one public, DeepSpeed-facing attribute, ``quantization_group_size`` (the group size in
force: G, or None when qwz does not gather), which the harness's probe reads like any
subject's report. :func:`state_of` is how the rest of qwz finds the object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qwz.collectives import GatherStats, Staging
from qwz.kernels import QuantKernels

if TYPE_CHECKING:
    from qwz.integrations.deepspeed.gather import FlatGroupPlan
    from qwz.integrations.deepspeed.resume import CheckpointLoad


@dataclass
class DropInState:
    """What qwz knows and counts about one DeepSpeed optimizer ([Note: drop-in state])."""

    plans: list[FlatGroupPlan] | None = None
    """One gather plan per DeepSpeed param group; None: the gather is stock."""
    preserve_numel: int | None = None
    """Parameters of at most this many elements travel exactly, as exact runs ([Note: small
    parameters travel exactly], qwz/layout.py; None: stock)."""
    kernels: QuantKernels | None = None
    """The gather's kernels (qwz.kernels.choose_kernels; None: stock)."""
    kernel_fallback: str | None = None
    """Why the fused kernels are not in use although wanted (None when they are)."""
    staging: Staging | None = None
    """The gather's staging buffers, allocated on first use and reused."""
    gather_stats: GatherStats | None = None
    """The last qwz gather, summed over param groups and chunks (None before the first)."""
    gathers: int = 0
    """How many qwz gathers ran."""
    checkpoint_load: CheckpointLoad | None = None
    """The checkpoint a ``load_checkpoint`` of the engine is loading, while it runs
    ([Note: lossless resume], resume.py)."""

    @property
    def taken_over(self) -> bool:
        """Whether qwz's gather replaced DeepSpeed's on this optimizer."""
        return self.plans is not None


def state_of(optimizer: Any) -> DropInState | None:
    """The :class:`DropInState` of `optimizer`, None for one that qwz's initialize did not
    build (a plain ``deepspeed.initialize``, or another optimizer class)."""
    state = getattr(optimizer, "qwz", None)
    return state if isinstance(state, DropInState) else None
