"""The weight gather's wire window: from the optimizer step to the next use of the weights.

[Note: the wire window]
The contract leaves free *when* the gather runs, as long as it is complete before the weights
are next used ([Note: observed at the next use], next_use.py). So the bytes the probe counts
([Note: wire accounting below every entry point], qwz/integrations/probe.py) are those of the same
window: it opens when the subject's training step begins (:meth:`WireWindow.open`; data moved before
the masters' optimizer step is the backward's) and closes when the observation at the next
use begins (:meth:`WireWindow.close`), before the observation's own collectives. A gather
the subject issues anywhere in between -- inside ``step()``, from a hook after it, or from a
forward pre-hook of the next forward -- is counted, whatever entry point it uses.

The harness's own work between the two (the loss averaged over the ranks, the agreed
failures, the gradient norm check, the step-1 digests, the next batch) runs *suspended*
(:meth:`WireWindow.suspend`: seen, not counted, on the harness's thread only) and the
window counts again from :meth:`WireWindow.resume`, called right before each call into the
subject's model: the next training forward, a held-out forward, the final forward. A step
that ends the arm closes its window unread.

The same window counts the gather's own memory ([Note: staging memory, exactly],
observers/staging_memory.py), more narrowly: only while the subject runs. It is suspended with
the probe, but counts again only from :meth:`WireWindow.subject_runs` -- the first forward
pre-hook of the model, ahead of the subject's own (a decode it defers to the next forward is
counted) -- not from :meth:`WireWindow.resume`, since what the harness does between the two
(a batch cast, the held-out batches) allocates memory that is not the gather's. It is read when
the window closes (``memory``).
"""

from __future__ import annotations

import contextlib

import torch

from qwz.integrations.probe import WireProbe
from qwz.qualify.run.observers.staging_memory import MemoryWindow, WindowMemory


class WireWindow:
    """One :class:`WireProbe` at a time, open from a step to the next use of its weights."""

    def __init__(self) -> None:
        self._probe: WireProbe | None = None
        self._memory: MemoryWindow | None = None
        self.memory: WindowMemory | None = None
        """The gather's memory in the window :meth:`close` last closed (None: not counted)."""
        self._open = contextlib.ExitStack()
        self._suspended = contextlib.ExitStack()

    @property
    def is_open(self) -> bool:
        return self._probe is not None

    def open(self, step_boundary: torch.optim.Optimizer | None) -> WireProbe:
        """Start counting (the subject's training step begins)."""
        if self._probe is not None:
            raise RuntimeError(
                "harness: a step's wire window opened while the previous step's is still open "
                "([Note: the wire window]): the weights were not used in between"
            )
        self._probe = self._open.enter_context(WireProbe(step_boundary=step_boundary))
        self._memory = MemoryWindow(step_boundary)
        return self._probe

    def suspend(self) -> None:
        """The harness's own work follows: its collectives are not the subject's."""
        if self._probe is not None:
            self._suspended.close()
            self._suspended.enter_context(self._probe.excluded())
        if self._memory is not None:
            self._memory.suspend()

    def resume(self) -> None:
        """The subject runs next (a forward of its model): count its collectives again."""
        self._suspended.close()

    def subject_runs(self) -> None:
        """The model's forward begins (its first pre-hook): count the subject's memory again."""
        if self._memory is not None:
            self._memory.resume()

    def close(self) -> WireProbe | None:
        """Stop counting; the window's probe (None when none was open)."""
        probe, self._probe = self._probe, None
        memory, self._memory = self._memory, None
        self.memory = memory.close() if memory is not None else None
        self._suspended.close()
        self._open.close()
        return probe
