"""[Note: the wire window] (qualify/run/wire_window.py): from a step to the next use of its
weights, the subject's collectives counted and the harness's not -- on a real one-rank gloo
group, so every call goes through torch.distributed's own entry points."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qwz.qualify.run.wire_window import WireWindow


@pytest.fixture()
def one_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def gather(elements: int) -> None:
    """A weight-gather-like collective sending `elements` bf16 values."""
    source = torch.zeros(elements, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(torch.empty_like(source), source)


def test_the_subject_is_counted_until_the_next_use_and_the_harness_never(one_rank):
    window = WireWindow()
    window.open(step_boundary=None)
    gather(10)  # inside step(): 20 B
    window.suspend()
    gather(1000)  # the harness: the loss averaged over the ranks, the agreed failures
    dist.all_reduce(torch.zeros(3))
    window.resume()
    gather(5)  # a forward pre-hook of the next forward: 10 B
    probe = window.close()
    gather(7)  # the observation at the next use, after the window
    assert probe is not None and not window.is_open
    assert probe.bytes["gather"] == 30 and probe.calls["gather"] == 2
    assert probe.excluded_calls == 2


def test_a_broken_window_would_be_caught_by_its_counts(one_rank):
    """What each of the window's edges guards: a window closed at step()'s return misses the
    pre-hook's gather; one never suspended counts the harness's collectives."""
    early = WireWindow()
    early.open(step_boundary=None)
    gather(10)
    missed = early.close()
    gather(5)  # the pre-hook's gather, after a too-early close
    assert missed.bytes["gather"] == 20
    never_suspended = WireWindow()
    never_suspended.open(step_boundary=None)
    gather(10)
    gather(1000)  # the harness's, counted when nothing suspends the window
    assert never_suspended.close().bytes["gather"] == 2020


def test_close_without_open_and_a_second_open_are_told_apart(one_rank):
    window = WireWindow()
    assert window.close() is None  # a step that ended the arm: nothing to read
    window.resume()  # before any step (a held-out forward at step 0): nothing to count
    window.open(step_boundary=None)
    with pytest.raises(RuntimeError, match=r"harness: .*previous step's is still open"):
        window.open(step_boundary=None)
    window.close()


def test_the_probe_is_restored_when_the_window_closes(one_rank):
    before = vars(dist.ProcessGroup).get("_allgather_base")
    window = WireWindow()
    window.open(step_boundary=None)
    window.suspend()
    assert vars(dist.ProcessGroup).get("_allgather_base") is not before
    window.close()
    assert vars(dist.ProcessGroup).get("_allgather_base") is before


def test_the_gathers_memory_counts_while_the_subject_runs_not_while_the_harness_prepares():
    """[Note: staging memory, exactly]: from the masters' update to the end of the step, then
    again from the model's first forward pre-hook -- never the harness's batch preparation
    between :meth:`resume` and the forward, nor anything before the optimizer's step."""
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    window = WireWindow()
    window.open(step_boundary=optimizer)
    torch.empty(4096, dtype=torch.int8)  # the backward's, before the step: not counted
    weight.grad = torch.ones(4)
    optimizer.step()
    step_buffer = torch.empty(256, dtype=torch.int8)  # the gather inside step(): counted
    window.suspend()
    harness = torch.empty(4096, dtype=torch.int8)  # the harness's own work
    window.resume()
    batch = torch.empty(2048, dtype=torch.int8)  # the next batch, cast before the forward
    window.subject_runs()  # the model's forward begins
    decode = torch.empty(128, dtype=torch.int8)  # a decode deferred to a forward pre-hook
    window.close()
    assert window.memory is not None and window.memory.peak_bytes == 256 + 128
    del step_buffer, harness, batch, decode
