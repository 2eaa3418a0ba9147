"""The gather's own memory, exactly: every tensor storage the subject allocates in the window.

[Note: staging memory, exactly]
The PR claims bounded memory: "weight partitions are quantized in bounded chunks". The wire
(qwz/integrations/probe.py) shows how large each collective is, not how much the gather holds
while it runs -- a PR may issue correctly sized collectives into a receive buffer allocated for
the whole partition, quantize the whole partition before its first call, or keep every
chunk's buffers until the end. Peak RSS cannot tell (page-granular, moved by the allocator by
megabytes), and CUDA's peak exists on a GPU only. So the harness counts storage itself:

- *What.* A ``TorchDispatchMode`` sees every aten op the subject runs on the rank's thread; an
  output whose storage is neither an input's nor one already counted is a new allocation of
  ``storage.nbytes()`` bytes (views and in-place results share an input's storage and are not),
  and a ``weakref.finalize`` on the storage (PyTorch keeps one Python object per storage) says
  when it is freed. The figure is exact bytes of tensor storage, on every device alike; an op's
  scratch inside one kernel is not a tensor the subject holds and is not seen, nor is memory a
  collective backend allocates on its own threads.
- *When.* The window of [Note: the wire window] (wire_window.py): from the subject's optimizer
  step that updates the masters to the next use of the weights, *minus* every call of that
  optimizer's ``step`` (its state and temporaries are the optimizer's, not the gather's; DeepSpeed
  steps it once per param group) and the harness's own work (suspended). Storage allocated
  before the window and still held (the flat buffers, persistent staging) is what the subject
  holds anyway and is not counted; storage allocated in it is, while it lives.
- *Where.* For each allocation the first frame outside torch and qwz's harness (the subject's
  own line) is kept, and at the peak the largest live allocations are listed, so a failure
  names them.

``bounded`` (qualify/evidence/rules/bounded.py) holds the peak over every step's window against the
contract's allowance (evidence/staging.py); the reference arm's peak, measured the same way,
is what its engine allocates around any gather.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode
from torch.utils._pytree import tree_flatten

LARGEST_KEPT = 5
"""Allocations listed at the peak."""
SITE_MIN_BYTES = 4096
"""Smaller allocations are counted but not located (a stack per allocation costs)."""
_HARNESS_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep,
)
"""Frames under these (torch, and qwz/qualify: the harness) are never the subject's line; qwz's
engine, a subject, lies outside the second."""


class Allocation(NamedTuple):
    bytes: int
    where: str
    """The subject's line that made it: ``path:line in function`` (shortened)."""


class WindowMemory(NamedTuple):
    """One window's figures."""

    peak_bytes: int
    largest: list[Allocation]
    """The largest allocations live at the peak, largest first."""
    allocations: int
    """New storages counted in the window."""


def _site() -> str:
    """The first frame outside torch and qwz's harness, e.g. ``runtime/utils.py:1093 in f``.
    Walks the frames themselves: ``traceback.extract_stack`` would read every frame's source
    line, once per allocation located."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if not filename.startswith(_HARNESS_DIRS) and not filename.startswith("<"):
            parts = filename.split(os.sep)
            return f"{os.sep.join(parts[-3:])}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "unknown"


class StagingMemory(TorchDispatchMode):
    """[Note: staging memory, exactly]: counts while active, between :meth:`start` and
    :meth:`stop` (pausable), from when it is entered until it exits."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self._live: dict[int, Allocation] = {}
        self._current = 0
        self.peak_bytes = 0
        self._largest: list[Allocation] = []
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            self._count(args, kwargs, out)
        return out

    def _count(self, args: Any, kwargs: Any, out: Any) -> None:
        outputs = [item for item in tree_flatten(out)[0] if isinstance(item, torch.Tensor)]
        if not outputs:
            return
        inputs = {
            id(item.untyped_storage())
            for item in tree_flatten((args, kwargs))[0]
            if isinstance(item, torch.Tensor) and item.device.type != "meta"
        }
        for tensor in outputs:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._live:
                continue
            size = storage.nbytes()
            where = _site() if size >= SITE_MIN_BYTES else "small"
            self._live[key] = Allocation(size, where)
            self._current += size
            self.allocations += 1
            weakref.finalize(storage, self._freed, key)
            if self._current > self.peak_bytes:
                self.peak_bytes = self._current
                self._largest = sorted(self._live.values(), reverse=True)[:LARGEST_KEPT]

    def _freed(self, key: int) -> None:
        allocation = self._live.pop(key, None)
        if allocation is not None:
            self._current -= allocation.bytes

    def result(self) -> WindowMemory:
        return WindowMemory(self.peak_bytes, list(self._largest), self.allocations)


class MemoryWindow:
    """One :class:`StagingMemory` from a step to the next use ([Note: staging memory,
    exactly]): entered at :meth:`open`, counting from the boundary optimizer's first
    ``step`` on, never inside that ``step`` nor while suspended."""

    def __init__(self, boundary: torch.optim.Optimizer | None) -> None:
        self.mode = StagingMemory()
        self._hooks: list[Any] = []
        self._suspended = False
        self._in_step = False
        self._stepped = False
        if boundary is not None:
            self._hooks = [
                boundary.register_step_pre_hook(self._step_begins),
                boundary.register_step_post_hook(self._step_ends),
            ]
        self.observed = boundary is not None
        """Without a torch optimizer to mark the masters' update, nothing is counted."""
        self._entered = False

    def _update(self) -> None:
        """Count now or not. The mode is entered only while it counts: an entered mode routes
        every aten op through Python (about ten times an op's own cost on small CPU tensors),
        and the optimizer's step and the harness's checks are many ops. It leaves the stack
        only from its top; under another mode pushed since, it stays, counting nothing."""
        active = self._stepped and not self._in_step and not self._suspended
        self.mode.active = active
        if active and not self._entered:
            self.mode.__enter__()
            self._entered = True
        elif not active and self._entered and _current_mode() is self.mode:
            self.mode.__exit__(None, None, None)
            self._entered = False

    def _step_begins(self, *_: Any) -> None:
        self._in_step = True
        self._update()

    def _step_ends(self, *_: Any) -> None:
        self._in_step, self._stepped = False, True
        self._update()

    def suspend(self) -> None:
        self._suspended = True
        self._update()

    def resume(self) -> None:
        self._suspended = False
        self._update()

    def close(self) -> WindowMemory | None:
        """Stop counting; the window's figures (None where nothing marked the update)."""
        self.mode.active = False
        if self._entered:
            self.mode.__exit__(None, None, None)
            self._entered = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return self.mode.result() if self.observed and self._stepped else None
