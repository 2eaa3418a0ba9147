"""qwz.probe.WireProbe: counting the bytes that go through torch.distributed."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qwz.probe import WireProbe

# --------------------------------------------------------------------------- #
# qwz.probe.WireProbe
# --------------------------------------------------------------------------- #

PROBED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
)


def dist_functions() -> dict[str, Any]:
    return {name: getattr(dist, name, None) for name in PROBED}


@pytest.fixture
def fake_deepspeed_backend(monkeypatch):
    """DeepSpeed's communication object caches two collectives ([Note: probing DeepSpeed's
    collectives]); a stand-in lets the test check they are re-pointed and restored."""
    backend = types.SimpleNamespace(
        all_gather_function=dist.all_gather_into_tensor,
        reduce_scatter_function=dist.reduce_scatter_tensor,
    )
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", types.SimpleNamespace(cdb=backend))
    return backend


def assert_wrapped(originals: dict[str, Any], backend: types.SimpleNamespace) -> None:
    for name, original in originals.items():
        if original is not None:
            assert getattr(dist, name) is not original, f"{name} is not wrapped"
    assert backend.all_gather_function is dist.all_gather_into_tensor
    assert backend.reduce_scatter_function is dist.reduce_scatter_tensor


def assert_restored(originals: dict[str, Any], backend: types.SimpleNamespace) -> None:
    for name, original in originals.items():
        assert getattr(dist, name, None) is original, f"{name} was not restored"
    assert backend.all_gather_function is originals["all_gather_into_tensor"]
    assert backend.reduce_scatter_function is originals["reduce_scatter_tensor"]


def test_wire_probe_restores_distributed_functions(fake_deepspeed_backend):
    originals = dist_functions()
    with WireProbe():
        assert_wrapped(originals, fake_deepspeed_backend)
    assert_restored(originals, fake_deepspeed_backend)


def test_wire_probe_restores_distributed_functions_after_an_exception(fake_deepspeed_backend):
    """Here the exception is a real one: a collective called without a process group. The
    probe counts the call (before it fails) and still restores everything."""
    originals = dist_functions()
    tensor = torch.zeros(5)
    with pytest.raises((RuntimeError, ValueError)), WireProbe() as probe:
        assert_wrapped(originals, fake_deepspeed_backend)
        dist.all_reduce(tensor)
    assert probe.calls["reduce"] == 1 and probe.bytes["reduce"] == 5 * 4
    assert_restored(originals, fake_deepspeed_backend)


def test_wire_probe_splits_gathers_by_process_group(monkeypatch):
    """Each gather is counted under the global ranks of the group it ran on, whether the
    group is passed by position or by keyword; the default group counts as the world."""
    expert_group = object()

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        return None

    def get_process_group_ranks(group):
        return [0, 2] if group is expert_group else [0, 1, 2, 3]

    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_process_group_ranks", get_process_group_ranks)
    with WireProbe() as probe:
        dist.all_gather_into_tensor(torch.empty(8), torch.empty(2), expert_group)
        dist.all_gather_into_tensor(
            torch.empty(8), input_tensor=torch.empty(3, dtype=torch.bfloat16), group=expert_group
        )
        dist.all_gather_into_tensor(torch.empty(16), torch.empty(4))
    assert probe.gather_bytes_by_group == {(0, 2): 2 * 4 + 3 * 2, (0, 1, 2, 3): 4 * 4}
    assert probe.gather_calls_by_group == {(0, 2): 2, (0, 1, 2, 3): 1}
    assert probe.bytes["gather"] == 30 and probe.calls["gather"] == 3


def test_probe_entry_that_fails_leaves_torch_distributed_unwrapped(monkeypatch):
    """A probe whose set-up fails half-way restores every function it had wrapped."""
    original = dist.all_gather_into_tensor
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: None)

    def fail(self):
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(WireProbe, "_repoint_deepspeed", fail)
    with pytest.raises(RuntimeError, match="set-up failed"), WireProbe():
        pass
    assert dist.all_gather_into_tensor is original
