"""Count the bytes that actually go through ``torch.distributed``, below every entry point.

The probe patches the methods of ``torch.distributed.ProcessGroup`` for the duration of a
``with`` block and records, per kind and per process group, how many calls were made, how
many bytes this rank sent and received, how many peer rows it received and how large the
outputs were. It is independent of what the code under test reports about itself, so tests
and the qualification can check those reports and catch a gather that silently falls back
to the unquantized path (which is what stock DeepSpeed does with ``zero_quantized_weights``
at stages 1 and 2).

[Note: wire accounting below every entry point]
Every Python entry point of ``torch.distributed`` -- ``all_gather_into_tensor``,
``all_gather``, ``distributed_c10d.*``, ``broadcast``, ``all_gather_object`` and
``broadcast_object_list``, ``all_to_all(_single)``, ``send``/``recv``/``isend``/``irecv`` and
``batch_isend_irecv``, the coalescing manager, async handles -- ends in a method of the
group's ``ProcessGroup`` object (``allgather``, ``_allgather_base``, ``all_gather_single``,
``allgather_coalesced``, ``broadcast``, ``alltoall_base``, ``send``, ``recv``, ...); so does
DeepSpeed's comm layer, which calls (and caches) those functions. Patching the class's
methods therefore counts every call whatever called it, once (the bindings call the backend
in C++, never another patched method), and a collective is counted when it is issued, so an
async one counts whether or not its handle is waited on inside the block.

Two more ways reach the backend without a ``ProcessGroup`` method, and both are counted per
process group like the others: functional collectives (``torch.ops._c10d_functional.*``,
``torch.distributed._functional_collectives``, DTensor), which name their group
([Note: functional collectives name their group], functional_wire.py), and a ``Backend``
object's methods called directly, attributed to the process group whose backend it is. What
moves data after the step boundary (below) and still cannot be attributed -- a functional
point-to-point op, a group name that does not resolve, a backend of no known group -- is
counted in ``uncounted_calls`` (by name in ``uncounted``), never silently dropped; a check
reading such a probe is inconclusive, never a pass or a fail. Such a call that reduces, or
that moves data before the boundary, is no part of the weight gather: it is counted under its
kind with group None. (A functional collective inside a compiled graph, or called through an
op overload such as ``.default``, is not seen at all.)

Kinds: ``reduce`` for the reductions (all-reduce, reduce, reduce-scatter: the gradients'),
``gather`` for every collective that moves data (gathers, broadcast, scatter, all-to-all,
point-to-point) -- the weight gather. Given ``step_boundary`` (the optimizer whose ``step``
updates the masters), data moved before its first ``step`` call in the block is kind
``backward`` (an MoE layer's all-to-all in the backward pass), kept apart from the weight
gather. ``excluded()`` marks the harness's own collectives inside the block.

Bytes: ``sent`` is what this rank contributes once (a gather's input, a broadcast's tensor
on its root, a send's tensor, an all-to-all's input less its own slot); ``received`` is what
reaches this rank from its peers (a gather's output less its own input, a broadcast's tensor
on the other ranks, a receive's tensor, an all-to-all's output less its own slot). ``rows``
counts the peer rows received (``W - 1`` per gathered tensor, one per broadcast or receive).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from qwz.integrations import functional_wire

GatherMethod = Callable[..., tuple[int, int, int, int]]
"""(group, args, kwargs) -> (sent, received, rows, output) bytes/rows of one call."""


tensor_bytes = functional_wire.tensor_bytes


def _tensors_count(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_tensors_count(item) for item in value)
    return 0


def _inputs_count(value: Any) -> int:
    """Input tensors of a gather: ``allgather([[...]], [x])`` and ``allgather([...], x)``."""
    return max(1, _tensors_count(value))


def _root(args: tuple, kwargs: dict, position: int) -> int:
    """The root (group rank) of a rooted call: an options object's ``rootRank`` or an int."""
    for value in (*args[position:], *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        root = getattr(value, "rootRank", None)
        if root is not None:
            return int(root)
    return 0


def _gather(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    output, inputs = args[0], args[1]
    sent, out = tensor_bytes(inputs), tensor_bytes(output)
    return sent, max(0, out - sent), (group.size() - 1) * _inputs_count(inputs), out


def _rooted_gather(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    output, inputs = args[0], args[1]
    root, me = _root(args, kwargs, 2), group.rank()
    sent, out = tensor_bytes(inputs), tensor_bytes(output)
    if me == root:
        return 0, max(0, out - sent), group.size() - 1, out
    return sent, 0, 0, out


def _scatter(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    output, inputs = args[0], args[1]
    root, me = _root(args, kwargs, 2), group.rank()
    out = tensor_bytes(output)
    if me == root:
        return max(0, tensor_bytes(inputs) - out), 0, 0, out
    return 0, out, 1, out


def _broadcast(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    tensors = args[0] if args else kwargs.get("tensors", kwargs.get("tensor"))
    size = tensor_bytes(tensors)
    if group.rank() == _root(args, kwargs, 1):
        return size, 0, 0, size
    return 0, size, _tensors_count(tensors), size


def _own_slot(total: int, splits: Any, me: int, world: int) -> int:
    splits = list(splits or [])
    if not splits:
        return total // max(1, world)
    return total * int(splits[me]) // max(1, sum(int(s) for s in splits))


def _all_to_all_single(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    output, inputs = args[0], args[1]
    me, world = group.rank(), group.size()
    out_splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
    in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
    sent, out = tensor_bytes(inputs), tensor_bytes(output)
    return (
        sent - _own_slot(sent, in_splits, me, world),
        out - _own_slot(out, out_splits, me, world),
        world - 1,
        out,
    )


def _all_to_all(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    outputs, inputs = list(args[0]), list(args[1])
    me = group.rank()
    own_in = tensor_bytes(inputs[me]) if me < len(inputs) else 0
    own_out = tensor_bytes(outputs[me]) if me < len(outputs) else 0
    out = tensor_bytes(outputs)
    return tensor_bytes(inputs) - own_in, out - own_out, max(0, len(outputs) - 1), out


def _send(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    return tensor_bytes(args[0]), 0, 0, 0


def _recv(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    size = tensor_bytes(args[0])
    return 0, size, _tensors_count(args[0]), size


def _reduce_in_place(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    size = tensor_bytes(args[0] if args else next(iter(kwargs.values()), None))
    return size, size, 0, size


def _reduce_scatter(group: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int]:
    output, inputs = args[0], args[1]
    return tensor_bytes(inputs), tensor_bytes(output), 0, tensor_bytes(output)


DATA_METHODS: dict[str, GatherMethod] = {
    "allgather": _gather,
    "_allgather_base": _gather,
    "all_gather_single": _gather,
    "allgather_coalesced": _gather,
    "allgather_into_tensor_coalesced": _gather,
    "all_gather_single_coalesced": _gather,
    "gather": _rooted_gather,
    "scatter": _scatter,
    "broadcast": _broadcast,
    "alltoall_base": _all_to_all_single,
    "all_to_all_single": _all_to_all_single,
    "alltoall": _all_to_all,
    "send": _send,
    "recv": _recv,
    "recv_anysource": _recv,
}
"""``ProcessGroup`` methods that move data ([Note: wire accounting below every entry point])."""
REDUCE_METHODS: dict[str, GatherMethod] = {
    "allreduce": _reduce_in_place,
    "allreduce_coalesced": _reduce_in_place,
    "reduce": _reduce_in_place,
    "reduce_scatter": _reduce_scatter,
    "_reduce_scatter_base": _reduce_scatter,
    "reduce_scatter_single": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter,
    "reduce_scatter_single_coalesced": _reduce_scatter,
}
BACKEND_METHODS = (*DATA_METHODS, *REDUCE_METHODS)
"""Methods of a ``Backend`` object: called directly they are uncounted (no group ranks)."""
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")
FUNCTIONAL_REDUCTIONS = frozenset(
    {
        "all_reduce",
        "all_reduce_",
        "all_reduce_coalesced",
        "all_reduce_coalesced_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    }
)
"""Functional ops and backend methods that reduce: their kind is known, and reductions are
never the weight gather, so they leave the gather's account complete (group: None)."""
FUNCTIONAL_OPS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out",
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "all_to_all_single",
    "broadcast",
    "broadcast_",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "isend",
    "irecv",
    "batch_p2p_ops",
)
"""Functional collectives: they reach the backend without a ``ProcessGroup`` method."""


class _CountedPacket:
    """An op packet whose calls are counted; every attribute (its overloads, its schema)
    is the packet's own, so code registering or inspecting the op sees the real one."""

    def __init__(self, packet: Any, counted: Callable[..., Any]) -> None:
        self._packet, self._counted = packet, counted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


@dataclasses.dataclass
class Traffic:
    """One kind of traffic over one process group, as this rank saw it."""

    calls: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    rows: int = 0
    """Peer rows received (W - 1 per gathered tensor, one per broadcast or receive)."""
    output_bytes: int = 0
    largest_output_bytes: int = 0


GroupKey = tuple[int, ...] | None
"""A process group's global ranks; None without a process group."""


def _group_of_backend(backend: Any) -> Any:
    """The ``ProcessGroup`` whose backend (for any device type) `backend` is; None if none."""
    from torch.distributed.distributed_c10d import _world

    device_types = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    for group in list(_world.pg_map):
        for device_type in device_types:
            try:
                if group._get_backend(torch.device(device_type)) is backend:
                    return group
            except (RuntimeError, ValueError):
                continue
    return None


class WireProbe:
    """``with WireProbe() as probe: ...`` then ``probe.bytes["gather"]``, ``probe.traffic``.

    This class is longer than 150 lines because every entry point it counts (a method each)
    feeds one account, which must see them all to be complete.

    See [Note: wire accounting below every entry point]. ``bytes`` and ``calls`` are per kind
    (bytes sent); ``received`` per kind too. ``traffic[kind][group]`` is a :class:`Traffic`
    per process group keyed by its global ranks. ``gather_bytes_by_group`` and
    ``gather_calls_by_group`` are the weight gather's sent bytes and calls per group, so a
    test can see that each of DeepSpeed's param groups (dense, and per expert-data-parallel
    group with MoE) gathered over its own group. Nested probes are not supported; the
    patched methods are restored on exit, also when the block raises.
    """

    def __init__(self, step_boundary: torch.optim.Optimizer | None = None) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.received: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.traffic: dict[str, dict[GroupKey, Traffic]] = collections.defaultdict(dict)
        self.largest_gather_output_bytes = 0
        self.uncounted: collections.Counter[str] = collections.Counter()
        self.excluded_calls = 0
        self._boundary = step_boundary
        self._stepped = step_boundary is None
        self._saved: list[tuple[Any, str, Any, bool]] = []
        self._hook: Any = None
        self._ranks: dict[int, GroupKey] = {}
        self._local = threading.local()

    # ---- what was seen -------------------------------------------------------------------
    @property
    def uncounted_calls(self) -> int:
        return sum(self.uncounted.values())

    @property
    def gather_bytes_by_group(self) -> dict[GroupKey, int]:
        return {group: item.sent_bytes for group, item in self.traffic["gather"].items()}

    @property
    def gather_calls_by_group(self) -> dict[GroupKey, int]:
        return {group: item.calls for group, item in self.traffic["gather"].items()}

    def gather_traffic(self, group: GroupKey) -> Traffic:
        """The weight gather's traffic over `group` (empty when there was none)."""
        return self.traffic["gather"].get(group, Traffic())

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """The harness's own collectives inside the block: seen, not counted."""
        self._local.excluded = getattr(self._local, "excluded", 0) + 1
        try:
            yield
        finally:
            self._local.excluded -= 1

    # ---- counting ------------------------------------------------------------------------
    def _group_key(self, group: Any) -> GroupKey:
        key = self._ranks.get(id(group))
        if key is None:
            key = tuple(dist.get_process_group_ranks(group))
            self._ranks[id(group)] = key
        return key

    def _count(self, kind: str, name: str, measure: GatherMethod, group: Any, args, kwargs):
        if getattr(self._local, "excluded", 0):
            self.excluded_calls += 1
            return
        try:
            key = self._group_key(group)
            sent, received, rows, output = measure(group, args, kwargs)
        except Exception:  # a group torch does not know, arguments not as documented
            self.uncounted[f"ProcessGroup.{name}"] += 1
            return
        self._record(kind, key, sent, received, rows, output)

    def _record(self, kind: str, key: GroupKey, sent: int, received: int, rows: int, output: int):
        if kind == "gather" and not self._stepped:
            kind = "backward"
        item = self.traffic[kind].setdefault(key, Traffic())
        item.calls += 1
        item.sent_bytes += sent
        item.received_bytes += received
        item.rows += rows
        item.output_bytes += output
        item.largest_output_bytes = max(item.largest_output_bytes, output)
        self.bytes[kind] += sent
        self.received[kind] += received
        self.calls[kind] += 1
        if kind == "gather":
            self.largest_gather_output_bytes = max(self.largest_gather_output_bytes, output)

    def _once(self, original: Any, count: Callable[[tuple, dict], None]) -> Any:
        """`original` wrapped so that `count(args, kwargs)` runs for the outermost call of a
        thread only: a counted call that reaches another patched one counts once."""
        local = self._local

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0) == 0:
                count(args, kwargs)
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth -= 1

        return counted

    def _counted(self, kind: str, name: str, original: Any, measure: GatherMethod) -> Any:
        """A ``ProcessGroup`` method: counted for its group."""
        return self._once(
            original,
            lambda args, kwargs: self._count(kind, name, measure, args[0], args[1:], kwargs),
        )

    def _unattributed(self, label: str, kind: str) -> None:
        """A call no group can be named for: a reduction, or data moved before the step
        boundary, is counted under group None (never the weight gather); data moved after it
        is uncounted: the weight gather's account is incomplete."""
        if getattr(self._local, "excluded", 0):
            self.excluded_calls += 1
            return
        if kind == "gather" and not self._stepped:
            kind = "backward"
        if kind == "gather":
            self.uncounted[label] += 1
            return
        self.traffic[kind].setdefault(None, Traffic()).calls += 1
        self.calls[kind] += 1

    def _uncountable(self, label: str, original: Any, kind: str = "gather") -> Any:
        """What no group can be named for: :meth:`_unattributed`."""
        return self._once(original, lambda args, kwargs: self._unattributed(label, kind))

    def _functional(self, label: str, op: str, original: Any, kind: str) -> Any:
        """A functional op, counted by the group it names where functional_wire measures it."""
        measure = functional_wire.MEASURES.get(op)
        return self._once(
            original, lambda args, kwargs: self._count_named(label, kind, measure, args, kwargs)
        )

    def _count_named(self, label: str, kind: str, measure: Any, args: tuple, kwargs: dict):
        if getattr(self._local, "excluded", 0):
            self.excluded_calls += 1
            return
        try:
            measured = measure(args, kwargs)
            key = self._group_key(measured.group)
        except Exception:  # no measure for it, a name that does not resolve, odd arguments
            self._unattributed(label, kind)
            return
        _, sent, received, rows, output = measured
        self._record(kind, key, sent, received, rows, output)

    def _backend_method(self, name: str, original: Any, kind: str, measure: GatherMethod):
        """A ``Backend`` method called directly: counted for the process group whose backend
        it is, else uncounted (named)."""

        def count(args: tuple, kwargs: dict) -> None:
            group = _group_of_backend(args[0])
            if group is None:
                self._unattributed(f"Backend.{name}", kind)
            else:
                self._count(kind, name, measure, group, args[1:], kwargs)

        return self._once(original, count)

    # ---- patching ------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        # The raw entry is what goes back: a pybind11 class stores its methods wrapped in
        # ``instancemethod``, which binds ``self``; ``getattr`` unwraps it to a builtin that
        # does not, and put back that way every later call would lose its group.
        entries = vars(owner)
        self._saved.append((owner, name, entries.get(name), name in entries))
        setattr(owner, name, replacement)

    def __enter__(self) -> WireProbe:
        try:
            self._patch_all()
        except BaseException:
            self.__exit__()  # never leave torch.distributed half patched
            raise
        return self

    def _patch_all(self) -> None:
        process_group = dist.ProcessGroup
        for kind, methods in (("gather", DATA_METHODS), ("reduce", REDUCE_METHODS)):
            for name, measure in methods.items():
                original = getattr(process_group, name, None)
                if original is not None:
                    self._patch(process_group, name, self._counted(kind, name, original, measure))
        backend = getattr(torch._C._distributed_c10d, "Backend", None)
        for name in BACKEND_METHODS if backend is not None else ():
            original = getattr(backend, name, None)
            if original is not None:
                kind = "reduce" if name in REDUCE_METHODS else "gather"
                measure = {**DATA_METHODS, **REDUCE_METHODS}[name]
                self._patch(backend, name, self._backend_method(name, original, kind, measure))
        for namespace_name in FUNCTIONAL_NAMESPACES:
            namespace = getattr(torch.ops, namespace_name)
            for op in FUNCTIONAL_OPS:
                try:
                    original = getattr(namespace, op)
                except (AttributeError, RuntimeError):
                    continue  # not an op of this torch
                label = f"{namespace_name}.{op}"
                kind = "reduce" if op in FUNCTIONAL_REDUCTIONS else "gather"
                counted = _CountedPacket(original, self._functional(label, op, original, kind))
                self._patch(namespace, op, counted)
        if self._boundary is not None:
            self._hook = self._boundary.register_step_pre_hook(self._step_began)

    def _step_began(self, *_: Any) -> None:
        self._stepped = True

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for owner, name, original, had in reversed(self._saved):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()
