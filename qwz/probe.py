"""Count the bytes that actually go through ``torch.distributed`` collectives.

The probe wraps the collective functions of ``torch.distributed`` for the
duration of a ``with`` block and records, per kind, how many calls were made
and how many bytes this rank put in (its input tensor). It is independent of
what qwz's own functions report about themselves, so tests and the
qualification can check those reports and catch a gather that silently falls
back to the unquantized path (which is what stock DeepSpeed does with
``zero_quantized_weights`` at stages 1 and 2).

[Note: probing DeepSpeed's collectives]
DeepSpeed's torch backend caches ``torch.distributed.all_gather_into_tensor``
and ``reduce_scatter_tensor`` on its communication object (``cdb``) when it is
created, so wrapping the module attributes alone would not see its calls. When
DeepSpeed is loaded, the probe also re-points those cached references at its
wrappers for the duration of the ``with`` block (only if they still are the
functions it wrapped), and restores them on exit.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# name -> index of the tensor argument whose bytes this rank contributes
_GATHERS = {"all_gather_single": 1, "all_gather_into_tensor": 1, "all_gather": 1}
_REDUCTIONS = {
    "all_reduce": 0,
    "reduce_scatter_single": 1,
    "reduce_scatter_tensor": 1,
    "reduce_scatter": 1,
}
_KINDS = {**{name: "gather" for name in _GATHERS}, **{name: "reduce" for name in _REDUCTIONS}}
_ARG_INDEX = {**_GATHERS, **_REDUCTIONS}
_DEEPSPEED_CACHED = {
    "all_gather_function": "all_gather_into_tensor",
    "reduce_scatter_function": "reduce_scatter_tensor",
}
_KEYWORDS = {0: ("tensor",), 1: ("input_tensor", "input", "input_list", "tensor")}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _global_ranks(group: Any) -> tuple[int, ...] | None:
    """The global ranks of `group` (None: the default group); None without a process group."""
    if not dist.is_initialized():
        return None
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class WireProbe:
    """``with WireProbe() as probe: ...`` then ``probe.bytes["gather"]``, ``probe.calls``.

    Nested probes are not supported; the wrapped functions are restored on exit.
    ``largest_gather_output_bytes`` is the largest output buffer of one gather call.
    ``gather_bytes_by_group`` and ``gather_calls_by_group`` split the gathers by the process
    group they ran on, keyed by its global ranks (``None`` without a process group), so a
    test can see that each of DeepSpeed's param groups (dense, and per expert-data-parallel
    group with MoE) gathered over its own group.
    """

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.largest_gather_output_bytes = 0
        self.gather_bytes_by_group: collections.Counter[tuple[int, ...] | None] = (
            collections.Counter()
        )
        self.gather_calls_by_group: collections.Counter[tuple[int, ...] | None] = (
            collections.Counter()
        )
        self._saved: dict[str, Callable[..., Any]] = {}
        self._repointed: list[tuple[Any, str, Callable[..., Any]]] = []

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind, index = _KINDS[name], _ARG_INDEX[name]
        parameters = list(inspect.signature(original).parameters)
        group_index = parameters.index("group") if "group" in parameters else len(parameters)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if len(args) > index:
                contributed = args[index]
            else:
                contributed = next((kwargs[k] for k in _KEYWORDS[index] if k in kwargs), None)
            self.bytes[kind] += _tensor_bytes(contributed)
            self.calls[kind] += 1
            if kind == "gather":
                output = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list"))
                self.largest_gather_output_bytes = max(
                    self.largest_gather_output_bytes, _tensor_bytes(output)
                )
                group = args[group_index] if len(args) > group_index else kwargs.get("group")
                ranks = _global_ranks(group)
                self.gather_bytes_by_group[ranks] += _tensor_bytes(contributed)
                self.gather_calls_by_group[ranks] += 1
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> WireProbe:
        try:
            for name in _ARG_INDEX:
                original = getattr(dist, name, None)
                if original is not None:
                    wrapped = self._wrap(name, original)
                    self._saved[name] = original
                    setattr(dist, name, wrapped)
            self._repoint_deepspeed()
        except BaseException:
            self.__exit__()  # never leave torch.distributed half wrapped
            raise
        return self

    def _repoint_deepspeed(self) -> None:
        """See [Note: probing DeepSpeed's collectives]."""
        comm = sys.modules.get("deepspeed.comm.comm")
        backend = getattr(comm, "cdb", None)
        for attribute, name in _DEEPSPEED_CACHED.items():
            cached = getattr(backend, attribute, None)
            if cached is not None and cached is self._saved.get(name):
                self._repointed.append((backend, attribute, cached))
                setattr(backend, attribute, getattr(dist, name))

    def __exit__(self, *exc: object) -> None:
        for backend, attribute, cached in self._repointed:
            setattr(backend, attribute, cached)
        self._repointed.clear()
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()
