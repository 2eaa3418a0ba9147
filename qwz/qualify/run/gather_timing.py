"""The weight gather's own time inside a timed step, read through each subject's seam.

[Note: gather phase timing]
A step's time mixes the forward, the backward, the reduction and the optimizer with the
weight gather that quantization exists to speed up, and on a small or CPU workload the
rest can drown the gather's gain in noise. So each timed step also measures the gather's
own time, by wrapping, for the duration of that step, the one function through which the
subject's engine gathers its weights:

* ``qwz``: the optimizer's ``gather_weights`` (its phase 4), as an attribute of the one
  optimizer object, which the optimizer's ``step`` looks up on itself;
* ``deepspeed`` and ``deepspeed-native``: ``all_gather_dp_groups`` of DeepSpeed's
  ``deepspeed.runtime.zero.stage_1_and_2`` (stock DeepSpeed's gather, which its ``step``
  looks up as a module global) and, for the drop-in's candidates, qwz's
  ``gather_optimizer_weights`` that the takeover's dispatcher calls in its place
  ([Note: what is replaced], qwz/integrations/deepspeed/takeover.py). A takeover captures
  the wrapped stock function and dispatches around it, so each gather is timed once.

Every wrapper is removed when the step returns, even on error. On a GPU the time is that
of CUDA events recorded on the current stream before and after the call (no extra
synchronisation inside the step; read after the step's closing synchronisation), on a CPU
the wall time of the call. A step in which the subject's engine never called the wrapped
function (a DeepSpeed whose step gathers some other way) reads ``None``: not measured,
never zero.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class GatherClock:
    """Accumulates the wrapped gathers of one step; ``read()`` after the step's sync."""

    def __init__(self) -> None:
        self.use_events = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cpu_seconds = 0.0
        self.events: list[tuple[Any, Any]] = []
        self.calls = 0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.use_events:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                try:
                    return function(*args, **kwargs)
                finally:
                    end.record()
                    self.events.append((start, end))
            start_s = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu_seconds += time.perf_counter() - start_s

        return timed

    def read(self) -> float | None:
        """Seconds the step spent in its weight gathers; None when it ran none."""
        if self.calls == 0:
            return None
        if self.use_events:
            return sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        return self.cpu_seconds


@contextlib.contextmanager
def _patched(owner: Any, name: str, clock: GatherClock, instance: bool) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, clock.wrap(original))
    try:
        yield
    finally:
        if instance:
            delattr(owner, name)  # the class's method shows through again
        else:
            setattr(owner, name, original)


@contextlib.contextmanager
def timed_gather(arm: Any) -> Iterator[GatherClock]:
    """[Note: gather phase timing] for one step of `arm` (an ArmEngine of subjects.py)."""
    from qwz.qualify.run.subjects import DeepSpeedArm, QwzArm

    clock = GatherClock()
    with contextlib.ExitStack() as stack:
        if isinstance(arm, QwzArm):
            if "gather_weights" in vars(arm.optimizer):
                raise RuntimeError("the optimizer's gather_weights is already wrapped")
            stack.enter_context(_patched(arm.optimizer, "gather_weights", clock, True))
        elif isinstance(arm, DeepSpeedArm):  # NativeDeepSpeedArm too
            from deepspeed.runtime.zero import stage_1_and_2

            # A DeepSpeed without that module-level gather has no gather phase to time: the
            # clock reads None (context only), never a crash blamed on the subject.
            if hasattr(stage_1_and_2, "all_gather_dp_groups"):
                stack.enter_context(_patched(stage_1_and_2, "all_gather_dp_groups", clock, False))
            if getattr(arm.optimizer, "qwz_gathers", None) is not None:
                from qwz.integrations.deepspeed import takeover

                stack.enter_context(_patched(takeover, "gather_optimizer_weights", clock, False))
        yield clock
