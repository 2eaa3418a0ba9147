"""The bytes of PyTorch's functional collectives, attributed to the process group they name.

[Note: functional collectives name their group]
``torch.ops._c10d_functional.*`` (what ``torch.distributed._functional_collectives``, DTensor and
``torch.compile``d code call) reach the backend without a ``ProcessGroup`` method, so the
probe's patch of those methods never sees them (qwz/integrations/probe.py). But each takes its
group by name (``group_name``, with ``group_size`` beside it), and a name resolves to the
``ProcessGroup`` (``distributed_c10d._resolve_process_group``), hence to its global ranks. Each
function below reads one op's arguments as the op's schema orders them and returns the group
and what this rank sent, received, how many peer rows and how large the output -- the same
quantities as a ``ProcessGroup`` method's (probe.py); an op whose arguments are not as its
schema says, or whose group does not resolve, is left to the probe's uncounted calls (named);
so is ``batch_p2p_ops`` (a list of sends and receives in one op), which is not measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Measured(NamedTuple):
    group: Any
    """The ``ProcessGroup`` the op named."""
    sent: int
    received: int
    rows: int
    output: int


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or of the tensors in (nested) lists of them; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position < len(args):
        return args[position]
    raise TypeError(f"no argument {name!r}")


def resolve(name: Any) -> Any:
    """The ``ProcessGroup`` a functional op names (a string, or a group passed through)."""
    if isinstance(name, dist.ProcessGroup):
        return name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(str(name))


def _all_gather(args: tuple, kwargs: dict, name_position: int = 2) -> Measured:
    """``all_gather_into_tensor(input, group_size, group_name)`` (``_out`` and ``_coalesced``
    alike: the inputs a list for the latter)."""
    inputs = _argument(args, kwargs, 0, "input" if "input" in kwargs else "inputs")
    group = resolve(_argument(args, kwargs, name_position, "group_name"))
    world = group.size()
    sent = tensor_bytes(inputs)
    pieces = len(inputs) if isinstance(inputs, (list, tuple)) else 1
    return Measured(group, sent, sent * (world - 1), (world - 1) * pieces, sent * world)


def _broadcast(args: tuple, kwargs: dict) -> Measured:
    """``broadcast(input, src, group_name)``: ``src`` is the group rank of the root."""
    tensor = _argument(args, kwargs, 0, "input")
    root = int(_argument(args, kwargs, 1, "src"))
    group = resolve(_argument(args, kwargs, 2, "group_name"))
    size = tensor_bytes(tensor)
    if group.rank() == root:
        return Measured(group, size, 0, 0, size)
    return Measured(group, 0, size, 1, size)


def _all_to_all_single(args: tuple, kwargs: dict) -> Measured:
    """``all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)``."""
    tensor = _argument(args, kwargs, 0, "input")
    out_splits = _argument(args, kwargs, 1, "output_split_sizes")
    in_splits = _argument(args, kwargs, 2, "input_split_sizes")
    group = resolve(_argument(args, kwargs, 3, "group_name"))
    me, world = group.rank(), group.size()
    row = tensor_bytes(tensor) // max(1, tensor.shape[0]) if tensor.dim() else 0
    sent = tensor_bytes(tensor)
    output = row * sum(int(size) for size in out_splits) if out_splits else sent
    own_in = row * int(in_splits[me]) if in_splits else sent // max(1, world)
    own_out = row * int(out_splits[me]) if out_splits else output // max(1, world)
    return Measured(group, sent - own_in, output - own_out, world - 1, output)


def _send(args: tuple, kwargs: dict) -> Measured:
    """``isend(tensor, dst, tag, group_name)``."""
    group = resolve(_argument(args, kwargs, 3, "group_name"))
    return Measured(group, tensor_bytes(_argument(args, kwargs, 0, "tensor")), 0, 0, 0)


def _receive(args: tuple, kwargs: dict) -> Measured:
    """``irecv(tensor, src, tag, group_name)``."""
    group = resolve(_argument(args, kwargs, 3, "group_name"))
    size = tensor_bytes(_argument(args, kwargs, 0, "tensor"))
    return Measured(group, 0, size, 1, size)


def _reduction(args: tuple, kwargs: dict, name_position: int = 2) -> Measured:
    """``all_reduce(input, reduce_op, group_name)``, ``reduce_scatter_tensor(input, reduce_op,
    group_size, group_name)`` and their coalesced forms: the group (the bytes do not decide
    anything: a reduction is never the weight gather)."""
    tensor = _argument(args, kwargs, 0, "input" if "input" in kwargs else "inputs")
    group = resolve(_argument(args, kwargs, name_position, "group_name"))
    size = tensor_bytes(tensor)
    return Measured(group, size, size, 0, size)


MEASURES: dict[str, Callable[[tuple, dict], Measured]] = {
    "all_gather_into_tensor": _all_gather,
    "all_gather_into_tensor_out": _all_gather,
    "all_gather_into_tensor_coalesced": _all_gather,
    "broadcast": _broadcast,
    "broadcast_": _broadcast,
    "all_to_all_single": _all_to_all_single,
    "isend": _send,
    "irecv": _receive,
    "all_reduce": _reduction,
    "all_reduce_": _reduction,
    "all_reduce_coalesced": _reduction,
    "all_reduce_coalesced_": _reduction,
    "reduce_scatter_tensor": lambda args, kwargs: _reduction(args, kwargs, 3),
    "reduce_scatter_tensor_coalesced": lambda args, kwargs: _reduction(args, kwargs, 3),
}
"""The functional ops measured by the group they name ([Note: functional collectives name
their group])."""
