"""qwz.integrations.probe.WireProbe: counting at the ProcessGroup methods, without a process group
(the entry points on real ranks: tests/multigpu/test_probe_entry_points.py)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from qwz.integrations import probe as probe_module
from qwz.integrations.probe import WireProbe


def patched_attributes() -> dict[str, object]:
    """The raw class entries (a pybind11 ``instancemethod`` binds ``self``; what ``getattr``
    returns does not, so restoring that would break every later call)."""
    names = {**probe_module.DATA_METHODS, **probe_module.REDUCE_METHODS}
    found = {f"pg.{name}": vars(dist.ProcessGroup).get(name) for name in names}
    found["functional"] = vars(torch.ops._c10d_functional).get("all_gather_into_tensor")
    return found


def test_every_method_is_patched_inside_and_restored_after():
    torch.ops._c10d_functional.all_gather_into_tensor  # noqa: B018 (cached on first use)
    before = patched_attributes()
    with WireProbe():
        inside = patched_attributes()
        assert all(inside[key] is not value for key, value in before.items() if value is not None)
    after = patched_attributes()
    assert all(after[key] is value for key, value in before.items())


def test_methods_are_restored_after_an_exception():
    """A real failure: a collective called without a process group."""
    before = patched_attributes()
    with pytest.raises((RuntimeError, ValueError)), WireProbe():
        dist.all_reduce(torch.zeros(5))
    after = patched_attributes()
    assert all(after[key] is value for key, value in before.items())


def test_a_set_up_that_fails_half_way_restores_what_it_patched(monkeypatch):
    before = patched_attributes()
    monkeypatch.setattr(probe_module, "FUNCTIONAL_NAMESPACES", ("_c10d_functional", "no_such"))

    class Failing:
        def __getattr__(self, name):
            raise KeyError(name)  # not an AttributeError: the set-up itself fails

    original = torch.ops.__class__.__getattr__

    def ops_getattr(self, name):
        return Failing() if name == "no_such" else original(self, name)

    monkeypatch.setattr(torch.ops.__class__, "__getattr__", ops_getattr)
    with pytest.raises(KeyError), WireProbe():
        pass
    after = patched_attributes()
    assert all(after[key] is value for key, value in before.items())


class FakeGroup:
    """What the measuring functions read of a group: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


ROOT_0 = types.SimpleNamespace(rootRank=0)


def bf16(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("method", "rank", "args", "expected"),
    [
        # (sent, received, peer rows, output bytes)
        ("_allgather_base", 1, (bf16(40), bf16(10)), (20, 60, 3, 80)),
        ("allgather", 0, ([[bf16(10)] * 4], [bf16(10)]), (20, 60, 3, 80)),
        ("allgather_coalesced", 0, ([[bf16(10)] * 4] * 2, [bf16(10)] * 2), (40, 120, 6, 160)),
        ("broadcast", 2, ([bf16(10)], types.SimpleNamespace(rootRank=2)), (20, 0, 0, 20)),
        ("broadcast", 1, ([bf16(10)], types.SimpleNamespace(rootRank=2)), (0, 20, 1, 20)),
        ("broadcast", 1, (bf16(10), 1), (20, 0, 0, 20)),
        ("alltoall_base", 0, (bf16(40), bf16(40), [], []), (60, 60, 3, 80)),
        ("alltoall_base", 0, (bf16(40), bf16(40), [10, 30, 0, 0], [4, 12, 12, 12]),
         (72, 60, 3, 80)),
        ("alltoall", 1, ([bf16(5)] * 4, [bf16(5)] * 4), (30, 30, 3, 40)),
        ("send", 0, ([bf16(10)], 1, 0), (20, 0, 0, 0)),
        ("recv", 0, ([bf16(10)], 1, 0), (0, 20, 1, 20)),
        ("gather", 0, ([[bf16(10)] * 4], [bf16(10)], ROOT_0), (0, 60, 3, 80)),
        ("gather", 3, ([], [bf16(10)], ROOT_0), (20, 0, 0, 0)),
        ("scatter", 3, ([bf16(10)], [], ROOT_0), (0, 20, 1, 20)),
        ("allreduce", 0, ([bf16(10)],), (20, 20, 0, 20)),
        ("_reduce_scatter_base", 0, (bf16(10), bf16(40)), (80, 20, 0, 20)),
    ],
)  # fmt: skip
def test_each_method_measures_what_this_rank_sent_and_received(method, rank, args, expected):
    methods = {**probe_module.DATA_METHODS, **probe_module.REDUCE_METHODS}
    assert methods[method](FakeGroup(rank, 4), args, {}) == expected


def test_calls_are_split_by_group_and_kind_and_counted_once(monkeypatch):
    """A counted method calling another counted one (a subclass's override) counts once;
    data moved before the optimizer's step is the backward's."""
    expert, world = FakeGroup(0, 2), FakeGroup(0, 4)
    ranks = {id(expert): (0, 2), id(world): (0, 1, 2, 3)}
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: ranks[id(group)])
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with WireProbe(step_boundary=optimizer) as probe:
        outer = probe._counted("gather", "outer", lambda g, *a: inner(g, *a), probe_module._gather)
        inner = probe._counted("gather", "inner", lambda g, *a: None, probe_module._gather)
        outer(world, bf16(8), bf16(2))  # before the step: the backward's
        optimizer.step()
        outer(world, bf16(8), bf16(2))
        outer(expert, bf16(8), bf16(4))
        measure = probe_module._reduce_in_place
        reduce = probe._counted("reduce", "allreduce", lambda g, *a: None, measure)
        reduce(world, [bf16(3)])
    assert probe.traffic["backward"][(0, 1, 2, 3)].calls == 1
    assert probe.gather_bytes_by_group == {(0, 1, 2, 3): 4, (0, 2): 8}
    assert probe.gather_calls_by_group == {(0, 1, 2, 3): 1, (0, 2): 1}
    assert probe.gather_traffic((0, 2)).received_bytes == 8
    assert probe.bytes["gather"] == 12 and probe.calls["gather"] == 2
    assert probe.bytes["reduce"] == 6 and probe.largest_gather_output_bytes == 16


def test_an_unattributable_call_is_uncounted_and_excluded_calls_are_not(monkeypatch):
    def unknown(group):
        raise ValueError("not a group torch knows")

    monkeypatch.setattr(dist, "get_process_group_ranks", unknown)
    with WireProbe() as probe:
        gather = probe._counted("gather", "allgather", lambda g, *a: None, probe_module._gather)
        gather(FakeGroup(0, 2), bf16(4), bf16(2))
        with probe.excluded():
            gather(FakeGroup(0, 2), bf16(4), bf16(2))
    assert probe.uncounted == {"ProcessGroup.allgather": 1} and probe.uncounted_calls == 1
    assert probe.excluded_calls == 1 and probe.bytes["gather"] == 0


def test_an_unattributable_reduction_or_backward_call_leaves_the_gather_complete():
    """A functional all-reduce, or data a functional op moves before the optimizer's step,
    is no part of the weight gather: counted under group None, not uncounted."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with WireProbe(step_boundary=optimizer) as probe:
        reduce = probe._uncountable("_c10d_functional.all_reduce", lambda: None, "reduce")
        gather = probe._uncountable("_c10d_functional.all_gather_into_tensor", lambda: None)
        reduce()
        gather()  # before the step: the backward's
        optimizer.step()
        reduce()
        gather()  # after it: the weight gather cannot be accounted for
    assert probe.traffic["reduce"][None].calls == 2
    assert probe.traffic["backward"][None].calls == 1
    assert probe.uncounted == {"_c10d_functional.all_gather_into_tensor": 1}


def test_the_functional_namespaces_are_wrapped_by_kind():
    """The real op packets: a functional all-reduce wraps as a reduction, an all-gather as a
    data move; both keep the packet's overloads for code that registers the op."""
    with WireProbe():
        packet = torch.ops._c10d_functional.all_gather_into_tensor
        assert isinstance(packet, probe_module._CountedPacket)
        assert packet.default is not None  # an overload, the packet's own
    assert "all_reduce" in probe_module.FUNCTIONAL_REDUCTIONS
    assert "all_gather_into_tensor" not in probe_module.FUNCTIONAL_REDUCTIONS
