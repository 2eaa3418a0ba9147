"""qwz.integrations.probe.WireProbe counts every entry point of torch.distributed ([Note: wire
accounting below every entry point], qwz/integrations/probe.py): on two gloo ranks, one rank body
runs each entry point once under its own probe and returns what the probe saw; each test asserts one
entry point's kind, calls and bytes sent and received over the world's group. The ranks run once
per session, shared by every case."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from qwz.integrations.probe import WireProbe

pytestmark = pytest.mark.multigpu

WORLD = 2
ROW = 6
"""Elements of each rank's row: small, distinct per dtype so the bytes tell the dtype."""


def _row(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.full((ROW,), float(dist.get_rank() + 1), dtype=dtype)


def _seen(probe: WireProbe) -> dict[str, Any]:
    world = tuple(range(dist.get_world_size()))
    return {
        "traffic": {
            kind: {
                "calls": item.calls,
                "sent": item.sent_bytes,
                "received": item.received_bytes,
                "rows": item.rows,
                "output": item.output_bytes,
            }
            for kind, groups in probe.traffic.items()
            for group, item in groups.items()
            if group == world
        },
        "uncounted": dict(probe.uncounted),
        "excluded_calls": probe.excluded_calls,
    }


def _all_gather_into_tensor() -> None:
    dist.all_gather_into_tensor(torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row())


def _all_gather() -> None:
    dist.all_gather([torch.empty(ROW, dtype=torch.bfloat16) for _ in range(WORLD)], _row())


def _c10d_all_gather_into_tensor() -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d.all_gather_into_tensor(torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row())


def _broadcast_per_source() -> None:
    for source in range(WORLD):
        dist.broadcast(_row(torch.uint8), src=source)


def _all_gather_object() -> None:
    dist.all_gather_object([None] * WORLD, b"x" * 100)


def _all_to_all_single() -> None:
    inputs = torch.cat([_row(torch.float32)] * WORLD)  # ROW elements for each rank
    dist.all_to_all_single(torch.empty(WORLD * ROW, dtype=torch.float32), inputs)


def _send_recv() -> None:
    peer = 1 - dist.get_rank()
    sent = dist.isend(_row(torch.uint8), dst=peer)
    received = dist.irecv(torch.empty(ROW, dtype=torch.uint8), src=peer)
    sent.wait()
    received.wait()


def _async_handle() -> None:
    work = dist.all_gather_into_tensor(
        torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row(), async_op=True
    )
    work.wait()


def _coalescing_manager() -> None:
    from torch.distributed.distributed_c10d import _coalescing_manager

    outputs = [torch.empty(WORLD * ROW, dtype=torch.bfloat16) for _ in range(2)]
    with _coalescing_manager(async_ops=True) as manager:
        for output in outputs:
            dist.all_gather_into_tensor(output, _row())
    manager.wait()


def _deepspeed_comm() -> None:
    import deepspeed.comm

    deepspeed.comm.all_gather_into_tensor(torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row())


def _all_reduce() -> None:
    dist.all_reduce(_row(torch.float32))


def _excluded(probe: WireProbe) -> None:
    with probe.excluded():
        dist.all_reduce(_row(torch.float32))
        dist.all_gather_into_tensor(torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row())


def _functional() -> None:
    from torch.distributed import _functional_collectives as functional

    functional.all_gather_tensor(_row(), 0, dist.group.WORLD).wait()


def _functional_broadcast() -> None:
    from torch.distributed import _functional_collectives as functional

    for source in range(WORLD):
        functional.broadcast(_row(torch.uint8), source, dist.group.WORLD).wait()


def _functional_all_to_all() -> None:
    from torch.distributed import _functional_collectives as functional

    inputs = torch.cat([_row(torch.float32)] * WORLD)
    functional.all_to_all_single(inputs, [ROW] * WORLD, [ROW] * WORLD, dist.group.WORLD).wait()


def _functional_batch_p2p() -> None:
    """A batch of point-to-point ops in one functional op: not measured, so uncounted."""
    peer = 1 - dist.get_rank()
    name = dist.group.WORLD.group_name
    tensors = [_row(torch.uint8), torch.empty(ROW, dtype=torch.uint8)]
    ops = ["isend", "irecv"] if dist.get_rank() == 0 else ["irecv", "isend"]
    tensors = tensors if dist.get_rank() == 0 else tensors[::-1]
    for work in torch.ops._c10d_functional.batch_p2p_ops(ops, [peer, peer], [0, 0], tensors, name):
        torch.ops._c10d_functional.wait_tensor(work)


def _backend_directly() -> None:
    """A Backend's method called without its ProcessGroup: the group whose backend it is."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    output = torch.empty(WORLD * ROW, dtype=torch.bfloat16)
    backend._allgather_base(output, _row()).wait()


def _functional_reduction() -> None:
    from torch.distributed import _functional_collectives as functional

    functional.all_reduce(_row(torch.float32), "sum", dist.group.WORLD).wait()


def _before_and_after_step(optimizer: torch.optim.Optimizer) -> None:
    """All-to-all before the optimizer's step (an MoE backward) and a gather after it."""
    _all_to_all_single()
    optimizer.step()
    dist.all_gather_into_tensor(torch.empty(WORLD * ROW, dtype=torch.bfloat16), _row())


CASES = {
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather": _all_gather,
    "distributed_c10d.all_gather_into_tensor": _c10d_all_gather_into_tensor,
    "broadcast per source": _broadcast_per_source,
    "all_gather_object": _all_gather_object,
    "all_to_all_single": _all_to_all_single,
    "isend/irecv": _send_recv,
    "async handle": _async_handle,
    "coalescing manager": _coalescing_manager,
    "deepspeed.comm": _deepspeed_comm,
    "all_reduce": _all_reduce,
    "functional": _functional,
    "functional broadcast": _functional_broadcast,
    "functional all_to_all_single": _functional_all_to_all,
    "functional batch_p2p_ops": _functional_batch_p2p,
    "backend directly": _backend_directly,
    "functional reduction": _functional_reduction,
}


def entry_points() -> dict[str, Any]:
    """Rank body: what a probe saw of each entry point, run alone under it."""
    try:
        import deepspeed.comm

        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    except ImportError:
        CASES.pop("deepspeed.comm")
    seen: dict[str, Any] = {}
    for name, case in CASES.items():
        with WireProbe() as probe:
            case()
        seen[name] = _seen(probe)
    with WireProbe() as probe:
        _excluded(probe)
    seen["excluded"] = _seen(probe)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with WireProbe(step_boundary=optimizer) as probe:
        _before_and_after_step(optimizer)
    seen["step boundary"] = _seen(probe)
    raw = vars(dist.ProcessGroup)
    before = (raw["allgather"], vars(torch.ops._c10d_functional)["all_gather_into_tensor"])
    with contextlib.suppress(RuntimeError), WireProbe():
        patched = raw["allgather"] is not before[0]
        raise RuntimeError("the block fails")
    after = (raw["allgather"], vars(torch.ops._c10d_functional)["all_gather_into_tensor"])
    # ... and every entry point works after the probes, outside any.
    total = torch.ones(1)
    dist.all_reduce(total)
    gathered = torch.empty(WORLD * ROW, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, _row())
    works = total.item() == WORLD and gathered.float().sum().item() == ROW * 3
    seen["restored"] = patched and works and all(a is b for a, b in zip(before, after, strict=True))
    return seen


@pytest.fixture(scope="module")
def seen(worlds):
    return worlds.run_once(WORLD, entry_points)


BF16_ROW = ROW * 2


@pytest.mark.parametrize(
    "case",
    [
        "all_gather_into_tensor",
        "all_gather",
        "distributed_c10d.all_gather_into_tensor",
        "async handle",
        "deepspeed.comm",
        "functional",
        "backend directly",
    ],
)
def test_a_gather_counts_its_row_sent_and_its_peer_s_received(seen, case):
    for rank in range(WORLD):
        if case not in seen[rank]:
            pytest.skip("deepspeed is not installed")
        gather = seen[rank][case]["traffic"]["gather"]
        assert gather["calls"] == 1, (case, gather)
        assert (gather["sent"], gather["received"], gather["rows"]) == (BF16_ROW, BF16_ROW, 1)
        assert gather["output"] == WORLD * BF16_ROW
        assert not seen[rank][case]["uncounted"]


def test_broadcast_per_source_is_received_from_the_other_source(seen):
    for rank in range(WORLD):
        gather = seen[rank]["broadcast per source"]["traffic"]["gather"]
        assert gather["calls"] == WORLD
        assert (gather["sent"], gather["received"], gather["rows"]) == (ROW, ROW, 1)


def test_all_gather_object_is_counted(seen):
    for rank in range(WORLD):
        gather = seen[rank]["all_gather_object"]["traffic"]["gather"]
        assert gather["calls"] == 2  # the sizes, then the pickled objects
        assert gather["received"] >= 100 and gather["sent"] >= 100


def test_all_to_all_counts_all_but_its_own_slot(seen):
    for rank in range(WORLD):
        gather = seen[rank]["all_to_all_single"]["traffic"]["gather"]
        peer_slot = ROW * 4  # one fp32 row for (and from) the other rank
        assert (gather["sent"], gather["received"], gather["rows"]) == (peer_slot, peer_slot, 1)


def test_point_to_point_counts_the_send_and_the_receive(seen):
    for rank in range(WORLD):
        gather = seen[rank]["isend/irecv"]["traffic"]["gather"]
        assert (gather["calls"], gather["sent"], gather["received"]) == (2, ROW, ROW)


def test_the_coalescing_manager_counts_every_gather_in_it(seen):
    for rank in range(WORLD):
        gather = seen[rank]["coalescing manager"]["traffic"]["gather"]
        assert (gather["sent"], gather["received"]) == (2 * BF16_ROW, 2 * BF16_ROW)
        assert gather["output"] == 2 * WORLD * BF16_ROW


def test_a_reduction_is_the_reduce_kind_not_the_gather(seen):
    for rank in range(WORLD):
        traffic = seen[rank]["all_reduce"]["traffic"]
        assert "gather" not in traffic and traffic["reduce"]["sent"] == ROW * 4


def test_functional_collectives_count_over_the_group_they_name(seen):
    """[Note: functional collectives name their group]: a broadcast per source and an
    all-to-all through the functional ops count as their ProcessGroup twins do."""
    for rank in range(WORLD):
        broadcast = seen[rank]["functional broadcast"]["traffic"]["gather"]
        assert (broadcast["calls"], broadcast["sent"], broadcast["received"]) == (WORLD, ROW, ROW)
        all_to_all = seen[rank]["functional all_to_all_single"]["traffic"]["gather"]
        assert (all_to_all["sent"], all_to_all["received"]) == (ROW * 4, ROW * 4)
        for case in ("functional broadcast", "functional all_to_all_single"):
            assert not seen[rank][case]["uncounted"], case


def test_what_no_group_can_be_named_for_is_uncounted_never_dropped(seen):
    for rank in range(WORLD):
        batch = seen[rank]["functional batch_p2p_ops"]
        assert batch["uncounted"] == {"_c10d_functional.batch_p2p_ops": 1}, batch
        assert "gather" not in batch["traffic"]


def test_a_functional_reduction_leaves_the_gather_s_account_complete(seen):
    for rank in range(WORLD):
        assert seen[rank]["functional reduction"]["uncounted"] == {}


def test_the_harness_s_own_collectives_are_excluded(seen):
    for rank in range(WORLD):
        excluded = seen[rank]["excluded"]
        assert excluded["traffic"] == {} and excluded["excluded_calls"] == 2


def test_data_moved_before_the_step_is_the_backward_s(seen):
    for rank in range(WORLD):
        traffic = seen[rank]["step boundary"]["traffic"]
        assert traffic["backward"]["calls"] == 1 and traffic["gather"]["calls"] == 1
        assert traffic["gather"]["sent"] == BF16_ROW


def test_every_patched_method_is_restored(seen):
    assert all(seen[rank]["restored"] for rank in range(WORLD))
