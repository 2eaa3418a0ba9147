"""Observe the weights where the training uses them: at the start of the next forward.

[Note: observed at the next use]
The contract ([Note: the contract and its freedoms], qualify/evidence/spec.py) leaves free
*when* the gather's decode completes, as long as it is complete before the weights are next
used: a PR may overlap the decode with the next step's data loading and finish it just
before the next forward (what DeepSpeed issue #6876 asks for). So what the working copy
holds -- the own shards, the replicas, the sampled values -- is observed when the model is
next run, not when ``step()`` returns.

:class:`NextUse` wraps the model's ``forward`` (an instance attribute over the class's):
``nn.Module.__call__`` runs every forward pre-hook first -- a candidate's decode hook
included, whenever it was registered -- and then ``forward``, so the pending observation
runs after them and before the model computes anything. The runner :meth:`defers
<NextUse.defer>` each step's observation; the next training forward, or a held-out
evaluation forward if one comes first, runs it. After the last step :meth:`settle` runs a
forward of the runner's choosing (the first batch after the run, gradients off) to observe
the last step too: a weight that is never used again must still be complete. A forward
that does not go through the wrapped ``forward``, or a step deferred while an earlier one is
still pending, is the harness's error, never the subject's.

The observation runs under ``torch.no_grad()`` and inside `pause` (the runner's: what it
allocates is not charged to the step's memory, [Note: peak around the train step]).
Collectives inside it are safe: every rank runs the same forwards in the same order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch


class NextUse:
    """Runs the deferred observation of `module`'s weights at its next forward."""

    def __init__(
        self,
        module: torch.nn.Module,
        pause: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ):
        self.module = module
        self.pause = pause or contextlib.nullcontext
        self._pending: tuple[str, Callable[[], None]] | None = None
        self._had_forward = "forward" in module.__dict__
        self._own_forward = module.__dict__.get("forward")
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            self.run_pending()
            return original(*args, **kwargs)

        module.forward = forward
        self._wrapper = forward

    @property
    def pending(self) -> str | None:
        """What is waiting for the next forward (its label), or None."""
        return None if self._pending is None else self._pending[0]

    def defer(self, label: str, observe: Callable[[], None]) -> None:
        """Run `observe` at the start of the module's next forward (`label` names it in an
        error)."""
        if self._pending is not None:
            raise RuntimeError(
                f"harness: {label} deferred while {self._pending[0]} still waits for a forward "
                "of the model ([Note: observed at the next use]): the model ran no forward "
                "through its forward() in between"
            )
        self._pending = (label, observe)

    def run_pending(self) -> None:
        """Run the pending observation now (what the wrapped forward does first)."""
        if self._pending is None:
            return
        _, observe = self._pending
        self._pending = None
        with self._observing():
            observe()

    @contextlib.contextmanager
    def _observing(self) -> Iterator[None]:
        with torch.no_grad(), self.pause():
            yield

    def settle(self, use: Callable[[], Any]) -> None:
        """After the last step: if an observation is pending, run `use` (a forward of the
        model, under no_grad) so the subject completes what it completes before a use, and
        the observation runs at its start. `use` must reach the wrapped forward."""
        if self._pending is None:
            return
        label = self._pending[0]
        with torch.no_grad():
            use()
        if self._pending is not None:
            raise RuntimeError(
                f"harness: the final forward did not reach the model's forward(), so {label} "
                "was never observed ([Note: observed at the next use])"
            )

    def close(self) -> None:
        """Restore the module's own ``forward`` (nothing pending is run)."""
        if self.module.__dict__.get("forward") is self._wrapper:
            if self._had_forward:
                self.module.forward = self._own_forward
            else:
                del self.module.forward
        self._pending = None
