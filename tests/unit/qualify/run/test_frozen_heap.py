"""[Note: a frozen heap] (qwz/qualify/run/heap.py): inside a qualification, the collection at
each arm's edge walks only what was made since the last one, and still frees the last arm's
cycles; the process's heap is left as it was found."""

from __future__ import annotations

import gc
import weakref

from qwz.qualify.run import heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    """A reference cycle only the garbage collector frees; a weak reference to one end."""
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_an_arms_cycles_are_freed_at_its_edge():
    with heap.frozen_heap():
        heap.release_memory()  # the edge before the first arm
        engine = _cycle()  # what an arm leaves behind
        heap.release_memory()  # the edge after it
        assert engine() is None


def test_what_survives_an_edge_is_not_walked_again():
    with heap.frozen_heap():
        before = gc.get_freeze_count()
        kept = [_Node() for _ in range(1000)]
        heap.release_memory()
        assert gc.get_freeze_count() >= before + len(kept)
    del kept


def test_the_heap_is_left_as_it_was_found():
    assert gc.get_freeze_count() == 0
    with heap.frozen_heap():
        assert gc.get_freeze_count() > 0
        heap.release_memory()
    assert gc.get_freeze_count() == 0
    assert not heap._FREEZE_SURVIVORS


def test_garbage_from_before_the_run_is_freed_when_it_ends():
    before = _cycle()
    with heap.frozen_heap():
        heap.release_memory()
        assert before() is not None  # frozen on entry: it waits for the end of the run
    gc.collect()
    assert before() is None


def test_a_heap_the_caller_froze_is_left_frozen():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with heap.frozen_heap():
            engine = _cycle()
            heap.release_memory()
            assert engine() is None
        assert gc.get_freeze_count() >= count
        assert not heap._FREEZE_SURVIVORS
    finally:
        gc.unfreeze()
