"""[Note: staging memory, exactly] (qwz/qualify/run/observers/staging_memory.py): the tensor
storage a gather allocates and holds at once, in exact bytes, from the masters' update to the
next use, the optimizer's step and the harness's work left out."""

from __future__ import annotations

import torch
from torch.utils import _python_dispatch

from qwz.qualify.evidence import staging
from qwz.qualify.run.observers.staging_memory import MemoryWindow, StagingMemory

KIB = 1024


def _gather_in_chunks(flat: torch.Tensor, chunk: int, keep: list | None = None) -> None:
    """A stand-in gather: per chunk, a received buffer (int8) and its fp32 decode, freed as it
    goes (or kept in `keep`, the broken way)."""
    for start in range(0, flat.numel(), chunk):
        received = torch.empty(chunk, dtype=torch.int8)
        decoded = received.float() * 0.5  # a 4-byte temporary, then the 4-byte result
        flat[start : start + chunk].copy_(decoded)
        if keep is not None:
            keep.append(received)
        del received, decoded


def test_a_new_allocation_is_counted_while_it_lives_and_views_are_not():
    with StagingMemory() as mode:
        mode.active = True
        first = torch.empty(256, dtype=torch.float32)  # 1 KiB
        view = first[:64]  # a view: the same storage
        first.add_(1)  # in place: the same storage
        second = first * 2  # 1 KiB more
        del second
        third = torch.empty(512, dtype=torch.int8)  # 512 B, after the second was freed
        del view, first, third
    result = mode.result()
    assert result.peak_bytes == 2 * KIB and result.allocations == 3


def test_a_buffer_the_size_of_the_partition_peaks_above_chunks_freed_as_they_go():
    flat = torch.zeros(64 * KIB)
    peaks = {}
    for how in ("chunked", "whole", "kept"):
        with StagingMemory() as mode:
            mode.active = True
            if how == "chunked":
                _gather_in_chunks(flat, 4 * KIB)
            elif how == "whole":
                whole = torch.empty(flat.numel(), dtype=torch.int8)  # up front, sliced per call
                for start in range(0, flat.numel(), 4 * KIB):
                    flat[start : start + 4 * KIB].copy_(whole[start : start + 4 * KIB].float())
                del whole
            else:
                kept: list = []
                _gather_in_chunks(flat, 4 * KIB, keep=kept)
                del kept
        peaks[how] = mode.result()
    # One chunk at a time: its 4 KiB of codes, the 16 KiB temporary and the 16 KiB decode.
    assert peaks["chunked"].peak_bytes == 4 * KIB + 2 * 16 * KIB
    # The whole partition's 64 KiB, and one chunk's 16 KiB cast beside it.
    assert peaks["whole"].peak_bytes == 64 * KIB + 16 * KIB
    # Every chunk's codes kept: 64 KiB, and the last chunk's temporary and decode.
    assert peaks["kept"].peak_bytes == 64 * KIB + 2 * 16 * KIB
    assert peaks["whole"].largest[0].bytes == 64 * KIB
    assert "test_staging_memory.py" in peaks["whole"].largest[0].where


def test_the_window_counts_after_the_optimizer_step_never_inside_it_nor_while_suspended():
    weight = torch.nn.Parameter(torch.zeros(1024))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    window = MemoryWindow(optimizer)
    before = torch.empty(1024)  # the backward's: before the step, not counted
    weight.grad = torch.ones(1024)
    optimizer.step()  # its state (8 KiB) and temporaries: the optimizer's
    gathered = torch.empty(256, dtype=torch.int8)  # 256 B: the gather's
    optimizer.step()  # a second step (DeepSpeed steps once per param group): still its own
    window.suspend()
    harness = torch.empty(4096)  # the harness's own work
    window.resume()
    more = torch.empty(128, dtype=torch.int8)  # 128 B more
    result = window.close()
    after = torch.empty(8192)  # after the window: not counted
    assert result.peak_bytes == 256 + 128 and result.allocations == 2
    del before, gathered, harness, more, after


class _PassThrough(_python_dispatch.TorchDispatchMode):
    """A mode a subject might push: every op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _dispatch_stack() -> list:
    return list(_python_dispatch._get_current_dispatch_mode_stack())


def test_the_mode_is_on_the_dispatch_stack_only_while_it_counts():
    """An entered mode sends every op through Python: the optimizer's step and the harness's
    work run without it, and the figures are the same."""
    weight = torch.nn.Parameter(torch.zeros(1024))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    window = MemoryWindow(optimizer)
    seen_in_step = []
    hook = optimizer.register_step_pre_hook(
        lambda *_: seen_in_step.append(window.mode in _dispatch_stack())
    )
    weight.grad = torch.ones(1024)
    assert window.mode not in _dispatch_stack()  # before the update
    optimizer.step()
    assert _dispatch_stack()[-1] is window.mode  # counting
    gathered = torch.empty(256, dtype=torch.int8)
    optimizer.step()
    assert seen_in_step == [False, False]
    window.suspend()
    assert window.mode not in _dispatch_stack()
    window.resume()
    assert _dispatch_stack()[-1] is window.mode
    result = window.close()
    assert window.mode not in _dispatch_stack() and result.peak_bytes == 256
    hook.remove()
    del gathered


def test_under_a_mode_pushed_since_it_stays_on_the_stack_and_counts_nothing():
    """The stack is last in, first out: a mode the subject pushed after the window began keeps
    the window's mode entered; suspended, it counts nothing all the same."""
    weight = torch.nn.Parameter(torch.zeros(16))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    window = MemoryWindow(optimizer)
    weight.grad = torch.ones(16)
    optimizer.step()
    with _PassThrough() as pushed:
        window.suspend()
        assert _dispatch_stack()[-2:] == [window.mode, pushed]  # the subject's mode kept on top
        ignored = torch.empty(4096)
        window.resume()
        counted = torch.empty(64, dtype=torch.int8)
    result = window.close()
    assert result.peak_bytes == 64 and window.mode not in _dispatch_stack()
    del ignored, counted


def test_without_a_torch_optimizer_to_mark_the_update_nothing_is_claimed():
    window = MemoryWindow(None)
    torch.empty(1024)
    assert window.close() is None


def test_the_allowance_holds_two_chunks_in_flight_and_one_chunk_of_fp32_workspace():
    bound = staging.collective_bound(
        bucket=8192, world_size=2, group_size=64, element_bytes=2, rank_exact_numel=0
    )
    allowance = staging.window_allowance_bytes(bound, world_size=2, exact_numel=100)
    in_flight = 2 * (bound.bound_bytes + -(-bound.bound_bytes // 2))
    assert allowance == in_flight + 4 * 4 * 8192 + 8 * 100
    # A receive buffer for a partition of 64 chunks exceeds it; two chunks do not.
    assert 64 * 4096 > allowance > 2 * bound.bound_bytes
