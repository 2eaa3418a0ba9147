"""The policies a :class:`~qwz.optimizer.ZeroOptimizer` is built from: frozen data, one
docstring per field, validated where they are declared.

The engine builds them from the config ([Note: one rank gathers exactly], engine.py, decides
``GatherPolicy.quantize``); nothing below the engine reads a config. A bad value raises
ValueError naming the field, the value and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from qwz import layout
from qwz.quant import check_group_size

OPTIMIZER_TYPES = ("adamw", "adam", "sgd")
"""The torch optimizers a ZeroOptimizer builds over its master shards (lower case)."""


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: {value!r} is invalid: must be an integer >= {minimum}")


@dataclass(frozen=True)
class OptimizerSpec:
    """The torch optimizer that steps the fp32 master shards
    ([Note: DeepSpeed's optimizer defaults], optimizer.py)."""

    type: str
    """One of :data:`OPTIMIZER_TYPES`."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Its hyperparameters, as DeepSpeed's config section gives them (``torch_adam`` and
    ``adam_w_mode`` included); a missing one is that optimizer's default."""

    def __post_init__(self) -> None:
        if self.type not in OPTIMIZER_TYPES:
            raise ValueError(f"type: {self.type!r} is invalid: must be one of {OPTIMIZER_TYPES}")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))


@dataclass(frozen=True)
class GatherPolicy:
    """The post-step weight all-gather (phase 4 of optimizer.py's docstring)."""

    quantize: bool
    """Send the large parameters as int8 codes and fp32 scales; False sends the working
    dtype through the very same chunking (the reference arm)."""
    group_size: int
    """Elements per quantization group; the large parameters' shards and chunks are whole
    groups of it even when not quantizing."""
    preserve_numel: int
    """Parameters of at most this many elements travel exactly, in the exact region
    ([Note: small parameters travel exactly], layout.py)."""
    bucket_size: int
    """``allgather_bucket_size`` (DeepSpeed's key, config.py): elements of the working dtype
    that both staging buffers together stay within ([Note: staging bound], layout.py, which
    plans with it in bytes: ``bucket_bytes``, each buffer's half ``buffer_bytes``)."""
    shard_alignment: int | None = None
    """The quantized region's shards are whole multiples of this many elements
    ([Note: padding rule], layout.py); None: the group size."""
    fused_kernels: bool | None = None
    """None: the fused kernels where a one-time probe shows they work on every rank, else
    eager on every rank (same bytes; collectives.agree_on_kernels); True: require the fused
    kernels; False: eager (qwz.kernels.choose_kernels)."""

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        _check_count("preserve_numel", self.preserve_numel, 0)
        _check_count("bucket_size", self.bucket_size, 1)
        layout.resolve_shard_alignment(
            self.shard_alignment, group_size=self.group_size, quantize=self.quantize
        )

    @property
    def resolved_shard_alignment(self) -> int:
        """The shard alignment in force: ``shard_alignment``, or the group size (validated
        once, when the policy was made)."""
        return self.group_size if self.shard_alignment is None else self.shard_alignment


@dataclass(frozen=True)
class ReducePolicy:
    """The gradient reduction (phase 1 of optimizer.py's docstring)."""

    bucket_size: int
    """``reduce_bucket_size`` (DeepSpeed's key, config.py): elements per reduction collective
    (collectives.py's ``bucket_numel``)."""
    dtype: torch.dtype | None = None
    """Dtype of the gradient collectives; None: the working dtype."""
    accumulate_dtype: torch.dtype = torch.float32
    """Dtype of the gradient accumulators between micro-batches."""

    def __post_init__(self) -> None:
        _check_count("bucket_size", self.bucket_size, 1)
        for name, value in (("dtype", self.dtype), ("accumulate_dtype", self.accumulate_dtype)):
            floating = isinstance(value, torch.dtype) and value.is_floating_point
            if not floating and not (name == "dtype" and value is None):
                raise ValueError(f"{name}: {value!r} is invalid: must be a floating-point dtype")
