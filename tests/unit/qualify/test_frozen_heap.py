"""[Note: a frozen heap] (qwz/qualify/run/runner.py): inside a qualification, the collection at
each arm's edge walks only what was made since the last one, and still frees the last arm's
cycles; the process's heap is left as it was found."""

from __future__ import annotations

import gc
import weakref

from qwz.qualify.run import runner


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    """A reference cycle only the garbage collector frees; a weak reference to one end."""
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_an_arms_cycles_are_freed_at_its_edge():
    with runner._frozen_heap():
        runner._release_memory()  # the edge before the first arm
        engine = _cycle()  # what an arm leaves behind
        runner._release_memory()  # the edge after it
        assert engine() is None


def test_what_survives_an_edge_is_not_walked_again():
    with runner._frozen_heap():
        before = gc.get_freeze_count()
        kept = [_Node() for _ in range(1000)]
        runner._release_memory()
        assert gc.get_freeze_count() >= before + len(kept)
    del kept


def test_the_heap_is_left_as_it_was_found():
    assert gc.get_freeze_count() == 0
    with runner._frozen_heap():
        assert gc.get_freeze_count() > 0
        runner._release_memory()
    assert gc.get_freeze_count() == 0
    assert not runner._FREEZE_SURVIVORS


def test_garbage_from_before_the_run_is_freed_when_it_ends():
    before = _cycle()
    with runner._frozen_heap():
        runner._release_memory()
        assert before() is not None  # frozen on entry: it waits for the end of the run
    gc.collect()
    assert before() is None


def test_a_heap_the_caller_froze_is_left_frozen():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with runner._frozen_heap():
            engine = _cycle()
            runner._release_memory()
            assert engine() is None
        assert gc.get_freeze_count() >= count
        assert not runner._FREEZE_SURVIVORS
    finally:
        gc.unfreeze()
