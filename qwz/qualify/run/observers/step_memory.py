"""An arm's memory: its training step's peak ([Note: peak around the train step]) and the
gather's own staging, exactly, in the window that counted it ([Note: staging memory, exactly],
staging_memory.py) -- the ``memory`` field of its observation.
"""

from __future__ import annotations

import contextlib
import resource
from typing import Any

import torch

from qwz.qualify.run.observers.arm_observer import ArmObserver, Window


def reset_peak_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "kind": "cuda",
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    return {
                        "kind": "rss",
                        "peak_allocated_bytes": peak,
                        "peak_reserved_bytes": None,
                    }
    except OSError:
        pass
    # ru_maxrss (KiB on Linux) cannot be reset: the process-wide peak.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": "rss", "peak_allocated_bytes": int(rss), "peak_reserved_bytes": None}


class StepPeak:
    """[Note: peak around the train step]
    An arm's memory is its training step's: forward, backward, reductions, optimizer step
    and gather, with the arm's resident state. The counter is reset before each step's
    forward and read right after its gather, and the record keeps the largest step; the
    harness's own checks (own-shard decode, digests, held-out loss) run outside that
    window, so what they allocate is not charged to the subject; the observation at the
    next use runs inside the next step's forward ([Note: observed at the next use]), so
    the window is paused around it (:meth:`paused`). An arm that never completed a step
    reports the peak since the arm began instead."""

    def __init__(self) -> None:
        self.steps = 0
        self.peak: dict[str, Any] | None = None
        self._window: dict[str, Any] | None = None
        """Inside a step: the peak of the parts of its window before a pause, else None."""

    @contextlib.contextmanager
    def around_step(self):
        reset_peak_memory()
        self._window = {}
        try:
            yield
            measured = self._merged(self._window, peak_memory())
        finally:
            self._window = None
        self.steps += 1
        self.peak = self._merged(self.peak or {}, measured)

    @contextlib.contextmanager
    def paused(self):
        """The harness's own work inside a step's window (the observation at the next use,
        next_use.py) is not charged to the step: the peak before it is kept, and the counter
        is reset after it. Outside a step, nothing to pause."""
        if self._window is None:
            yield
            return
        self._window = self._merged(self._window, peak_memory())
        try:
            yield
        finally:
            reset_peak_memory()

    @staticmethod
    def _merged(kept: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
        if not kept:
            return dict(measured)
        merged = dict(kept)
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            if measured[key] is not None:
                merged[key] = max(merged[key] or 0, measured[key])
        return merged

    def result(self) -> dict[str, Any]:
        assert self.peak is not None
        return dict(self.peak)


class ArmMemory(ArmObserver):
    """The memory observer: the step's peak (:class:`StepPeak`, whose window the loop opens
    around each training step) and the largest staging any wire window held."""

    def __init__(self) -> None:
        self.peak = StepPeak()
        self.staging: dict[str, Any] = {}
        """The largest window's memory ([Note: staging memory, exactly])."""

    def window_closed(self, window: Window) -> None:
        memory = window.memory
        if window.probe is None or memory is None:
            return
        if memory.peak_bytes >= self.staging.get("peak_bytes", -1):
            self.staging = {
                "peak_bytes": memory.peak_bytes,
                "largest": [list(item) for item in memory.largest],
            }

    def report(self) -> dict[str, Any]:
        memory = self.peak.result() if self.peak.steps else peak_memory()
        if self.staging:
            memory = memory | {
                "staging_peak_bytes": self.staging["peak_bytes"],
                "staging_largest": self.staging["largest"],
            }
        return {"memory": memory}
