"""The rank's heap between arms: what one arm freed is returned before the next begins, so its
peak is its own, without a full collection's walk over every object the process holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator

import torch

_FREEZE_SURVIVORS = False
"""True inside :func:`frozen_heap`: :func:`release_memory` freezes what survives it."""


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """[Note: a frozen heap]
    Every arm starts and ends with :func:`release_memory`, whose ``gc.collect()`` frees the
    last arm's engine (DeepSpeed's and torch's modules hold reference cycles). A full
    collection walks every tracked object of the process, and once torch, inductor and
    DeepSpeed are imported that is about 400,000 objects: 0.3 s per call on an idle core,
    and more in a rank reused by tests, whose heap grows test after test (the mutation suite
    took 38% less CPU without those walks). What survives a collection at an arm's edge
    (modules imported so far, their functions and tables, the run's observations) lives to
    the end of the run, so the context moves what exists when it is entered, and each
    collection its survivors, to the permanent generation (``gc.freeze()``); the next
    collection walks only what was made since: the last arm's engine, freed as before. On
    exit the survivors go back (``gc.unfreeze()``), so a rank reused by tests is left as it
    was found; an object frozen at one edge that becomes garbage later (or was garbage on
    entry) is freed then, not at the next edge. A heap the caller froze is left to the
    caller."""
    global _FREEZE_SURVIVORS
    if gc.get_freeze_count() or _FREEZE_SURVIVORS:
        yield
        return
    gc.freeze()
    _FREEZE_SURVIVORS = True
    try:
        yield
    finally:
        _FREEZE_SURVIVORS = False
        gc.unfreeze()


def release_memory() -> None:
    """Return freed memory to the device and the OS, so the next arm's peak is its own
    ([Note: a frozen heap])."""
    gc.collect()
    if _FREEZE_SURVIVORS:
        gc.freeze()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
