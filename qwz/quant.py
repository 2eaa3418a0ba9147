"""Pure group-wise symmetric int8 quantization.

Nothing here knows about processes or configs. The flat primitives
(:func:`quantize_groups`, :func:`dequantize_groups`) are what the gather calls
on every chunk; :func:`quantize` / :func:`dequantize` wrap them for tensors of
any shape. Both are straight-line tensor code (no data-dependent Python branch,
no ``.item()``), so ``torch.compile`` can fuse them.

[Note: quantization math]
For each group of ``G`` consecutive elements, in fp32 whatever the input dtype
(never staged through fp16, so bf16 values beyond 65504 stay finite)::

    scale = absmax / 127            # fp32, >= 0 (see the two edge cases below)
    code  = round(x / scale)        # int8 in [-127, 127]; 0 where scale == 0
    x_hat = code * scale            # fp32, then cast to the working dtype

``absmax`` maps to exactly 127 (not 128 clamped to 127), so the error bound
``|x_hat - x| <= scale / 2`` holds for every finite element (before the cast
back, up to the fp32 rounding of the division and the product, a few 2**-24 of
a scale), and an all-zero group has scale 0 and decodes to exact zeros. Two edge
cases of fp32 adjust the scale: a nonzero scale is at least the smallest normal
fp32 (2**-126), so groups whose absmax is below ~2**-119 keep the bound with that
scale instead of a subnormal one; and a scale whose ``127 * scale`` would round up
to inf (absmax at the very top of the fp32 range) is one ulp smaller.

Non-finite input: a group that holds a NaN or an Inf gets a non-finite scale
(NaN or Inf), and every element of that group decodes to NaN or Inf. A finite
group never decodes to a non-finite value and a non-finite group never decodes
to finite values, so a bad weight is never silently spread as a plausible one;
the engine detects it before the gather and raises with the parameter's name.

Shapes::

    x                  any shape, numel N, dtype fp32 / bf16 / fp16
    codes              int8    (ceil(N / G), G)   last group zero-padded
    scales             float32 (ceil(N / G),)
    dequantize(q)      x's shape, x's dtype unless `dtype` is given
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from qwz.config import DEFAULT_GROUP_SIZE

INT8_MAX = 127
"""Largest code magnitude; the code range is symmetric, [-127, 127]."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedTensor(NamedTuple):
    """Group-wise int8 codes and fp32 scales of a tensor, with what is needed to restore it."""

    codes: torch.Tensor
    """int8, (num_groups, group_size)."""
    scales: torch.Tensor
    """float32, (num_groups,)."""
    shape: torch.Size
    """Shape of the original tensor."""
    dtype: torch.dtype
    """Dtype of the original tensor."""

    @property
    def numel(self) -> int:
        """Elements of the original tensor (excluding the padding of the last group)."""
        return self.shape.numel()

    @property
    def group_size(self) -> int:
        return self.codes.shape[1]


def check_group_size(group_size: int) -> int:
    """Raise ValueError unless `group_size` is a positive int (bools are not ints)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: {group_size!r} is invalid: must be a positive integer")
    return group_size


def quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of `groups` (num_groups, group_size), any float dtype.

    Returns ``(codes, scales)``: int8 (num_groups, group_size) and float32 (num_groups,).
    See [Note: quantization math].
    """
    values = groups.to(torch.float32)
    absmax = values.abs().amax(dim=1)  # (num_groups,)
    # A nonzero scale is at least the smallest normal fp32: a subnormal scale would lose
    # its precision (or flush to zero) and break the error bound.
    scales = torch.where(
        absmax == 0, absmax, torch.clamp(absmax / INT8_MAX, min=torch.finfo(torch.float32).tiny)
    )
    # Next to the top of the fp32 range, 127 * fl(absmax / 127) can round up to inf; step
    # such a scale down by one ulp so a finite group always decodes to finite values.
    overflows = torch.isinf(scales * INT8_MAX) & torch.isfinite(absmax)
    scales = torch.where(overflows, torch.nextafter(scales, torch.zeros_like(scales)), scales)
    # A zero scale divides by one instead, so 0 / 1 gives the exact zero code;
    # NaN/Inf scales pass through and poison the whole group on decode.
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(values / divisor[:, None])
    # NaN codes (from a non-finite group) become 0 so every code stays in range;
    # the group's non-finite scale still decodes it to non-finite values.
    codes = torch.nan_to_num(codes, nan=0.0).clamp_(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scales


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode int8 `codes` (num_groups, group_size) with fp32 `scales` (num_groups,) to `dtype`."""
    return (codes.to(torch.float32) * scales[:, None]).to(dtype)


def pack_groups(
    values: torch.Tensor,
    row: torch.Tensor,
    group_size: int,
    quantize_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_groups,
) -> None:
    """Quantize `values` (n,) into one wire row: `row` (n + 4 * n / G,) uint8 receives the
    int8 codes, then the fp32 scales, as raw bytes. `n` must be a multiple of `group_size`."""
    numel = values.numel()
    codes, scales = quantize_fn(values.view(-1, group_size))
    row[:numel].copy_(codes.view(-1).view(torch.uint8))
    row[numel:].copy_(scales.view(torch.uint8))


def unpack_groups(rows: torch.Tensor, out: torch.Tensor, group_size: int) -> None:
    """Decode wire rows (W, n + 4 * n / G) uint8 into `out` (W, n), any float dtype (may be a
    strided view), the inverse of :func:`pack_groups` applied row by row."""
    numel = out.shape[1]
    codes = rows[:, :numel].view(torch.int8).reshape(-1, group_size)
    scales = rows[:, numel:].view(torch.float32).reshape(-1)
    out.copy_(dequantize_groups(codes, scales, out.dtype).view(out.shape))


class QuantKernels(NamedTuple):
    """The wire-format kernels a gather uses: eager, or fused by ``torch.compile``."""

    pack: Callable[[torch.Tensor, torch.Tensor, int], None]
    unpack: Callable[[torch.Tensor, torch.Tensor, int], None]


EAGER_KERNELS = QuantKernels(pack_groups, unpack_groups)


@functools.cache
def compiled_kernels() -> QuantKernels:
    """The same math fused by ``torch.compile`` (compiled on first use, per shape).

    Fusion matters: eager, each step of the math is a pass over memory and the quantized
    gather ends up slower than sending bf16. The fused kernels may round ``x / scale``
    through a reciprocal, so their codes can differ from the eager ones by one; every rank
    uses the same kernels, so replicas stay bit-identical, and the error bound of
    [Note: quantization math] still holds.
    """
    # The byte-level copies into the wire row stay eager (they are plain memcpys); the
    # quantize math is what fusion speeds up.
    fused_quantize = torch.compile(quantize_groups, dynamic=False)
    return QuantKernels(
        functools.partial(pack_groups, quantize_fn=fused_quantize),
        torch.compile(unpack_groups, dynamic=False),
    )


@functools.cache
def compile_available() -> bool:
    """Whether ``torch.compile`` works here (on CPU it needs a C++ compiler): compiles and
    runs the quantize kernel once on a small tensor."""
    try:
        compiled_kernels().pack(
            torch.ones(2 * DEFAULT_GROUP_SIZE),
            torch.empty(2 * DEFAULT_GROUP_SIZE + 8, dtype=torch.uint8),
            DEFAULT_GROUP_SIZE,
        )
    except Exception:
        return False
    return True


def quantize(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedTensor:
    """Quantize `x` (any shape; fp32, bf16 or fp16) to int8 in groups of `group_size` elements.

    The flattened tensor is split into consecutive groups; the last is padded with zeros.
    Runs on whatever device `x` lives on.
    """
    check_group_size(group_size)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} is invalid: must be one of {SUPPORTED_DTYPES}")
    flat = x.detach().reshape(-1)
    num_groups = -(-flat.numel() // group_size)
    padding = num_groups * group_size - flat.numel()
    if padding:
        flat = torch.nn.functional.pad(flat, (0, padding))
    codes, scales = quantize_groups(flat.view(num_groups, group_size))
    return QuantizedTensor(codes=codes, scales=scales, shape=x.shape, dtype=x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Restore a tensor of `q.shape` in `dtype` (default: the original dtype)."""
    out_dtype = q.dtype if dtype is None else dtype
    flat = dequantize_groups(q.codes, q.scales, out_dtype).reshape(-1)
    return flat[: q.numel].reshape(q.shape)


def group_scales(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The scale of each group of `values` ((k * group_size,) any float dtype), exactly as
    :func:`quantize_groups` computes it: (k,) float32."""
    return quantize_groups(values.reshape(-1, group_size))[1]
