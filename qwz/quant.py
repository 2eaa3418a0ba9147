"""Pure group-wise symmetric int8 quantization, and the wire format of the quantized gather.

Nothing here knows about processes or configs. This module owns the numbers every other
module relies on: :data:`DEFAULT_GROUP_SIZE`, the scale formula (:func:`scale_from_absmax`,
:func:`group_scales`), the decode error bound (:data:`DECODE_ERROR_SLACK`) and the byte
layout of one rank's wire row (:class:`WireRow`). The eager kernels (:func:`encode_into`,
:func:`decode_into`) are straight-line tensor code (no data-dependent Python branch, no
``.item()``), so ``torch.compile`` can fuse them; qwz/kernels/ chooses between them, the
fused ones and qwz's native one-pass C kernels (native.py), which compute the same bytes.

[Note: quantization math]
For each group of ``G`` consecutive elements, in fp32 whatever the input dtype
(never staged through fp16, so bf16 values beyond 65504 stay finite)::

    scale = absmax / 127            # fp32, correctly rounded; >= 0 (two edge cases below)
    code  = round(x * (1 / scale))  # int8 in [-127, 127]; 0 where scale == 0
    x_hat = code * scale            # fp32, then cast to the working dtype

``absmax`` maps to 127 (not 128 clamped to 127), and an all-zero group has scale 0 and
decodes to exact zeros. The code multiplies by the fp32 reciprocal of the scale instead of
dividing (a division costs several multiplies on CPU): ``fl(x * fl(1 / scale))`` differs from
``x / scale`` by at most ``|x / scale| * (2 * 2**-24 + 2**-48) <= 127 * 2**-23`` of a code,
so the code can round the other way when ``x / scale`` lies that close to a half-integer;
the product ``code * scale`` adds at most ``127 * 2**-24`` of a scale. Hence, for every
finite element, before the cast back to the working dtype::

    |x_hat - x| <= scale / 2 + DECODE_ERROR_SLACK * scale,   DECODE_ERROR_SLACK = 2**-15

(``127 * 2**-23 + 127 * 2**-24 ~ 2.3e-5 < 2**-15 ~ 3.05e-5``). Two edge cases of fp32 adjust
the scale: a nonzero scale is at least the smallest normal fp32 (2**-126), so groups whose
absmax is below ~2**-119 keep the bound with that scale instead of a subnormal one (and
``1 / scale`` stays finite); and a scale whose ``127 * scale`` would round up to inf (absmax
at the very top of the fp32 range) is one ulp smaller.

Eager and fused kernels compute the same expression in the same order and produce the same
bytes (tested), so ranks can never diverge by kernel choice.

[Note: exact division]
The two divisions of the quantizer, ``absmax / 127`` and ``1 / scale``, are computed in fp64
and rounded once to fp32, which gives the correctly rounded fp32 quotient however the
division is lowered: eager CUDA divides by a CPU scalar as a multiply by its reciprocal,
inductor rewrites a division by a constant into one on CUDA, and Triton's fp32 ``/`` is an
approximate division (2 ulp). In fp64 each of these is within ``2**-51`` (relative) of the
exact quotient, while an fp32 quotient of these operands is never that close to a rounding
boundary of fp32 (a midpoint between two fp32 values): ``a / 127`` for a 24-bit ``a`` is at
least ``2**-32`` away (relative), ``1 / s`` at least ``2**-49``, and neither is ever a
midpoint itself. So the fp32 result is the one ``fl32(a / b)`` of the CPU (and of
csrc/wire_kernels.c), on every device and kernel; the fp64 work is per group, not per
element.

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

[Note: wire row]
One rank's contribution to one gather collective is a row of bytes::

    [ scales: 4 * U ][ codes: U * G ][ exact: E * element_size ][ pad to 4 ]

``U`` quantization groups (fp32 scales first, so they sit at a 4-byte aligned offset), their
int8 codes, then ``E`` exact elements in the working dtype ([Note: small parameters travel
exactly], layout.py), then at most 3 zero bytes so that the next rank's row, and with it its
scales, starts 4-byte aligned. Without quantization the row is
``[ values: U * G ][ exact: E ]`` in the working dtype, which needs no padding.
Every rank's row of one collective has the same length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qwz.sizes import ceil_div, round_up

DEFAULT_GROUP_SIZE = 64
"""Elements per quantization group (one fp32 scale each)."""

INT8_MAX = 127
"""Largest code magnitude; the code range is symmetric, [-127, 127]."""

SCALE_BYTES = 4
"""Bytes of one fp32 scale on the wire."""

DECODE_ERROR_SLACK = 2.0**-15
"""Beyond half a scale, the most an element decodes away from its fp32 value, in scales
(before the cast to the working dtype); see [Note: quantization math]."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """The scale of each group from its fp32 absmax: ``absmax / 127``, zero for a zero group,
    a nonzero scale at least 2**-126, one ulp smaller where ``127 * scale`` would overflow.
    The one scale formula of qwz; see [Note: quantization math]."""
    absmax = absmax.to(torch.float32)
    # [Note: exact division]: the fp32 quotient through fp64, whatever lowers the division.
    quotient = (absmax.to(torch.float64) / INT8_MAX).to(torch.float32)
    scales = torch.where(
        absmax == 0, absmax, torch.clamp(quotient, min=torch.finfo(torch.float32).tiny)
    )
    overflows = torch.isinf(scales * INT8_MAX) & torch.isfinite(absmax)
    scales = torch.where(overflows, torch.nextafter(scales, torch.zeros_like(scales)), scales)
    # One NaN bit pattern, whichever kernel computed it (vectorized max may keep another
    # payload or sign), so a poisoned group is the same bytes on the wire either way.
    return torch.where(torch.isnan(scales), torch.full_like(scales, torch.nan), scales)


def group_scales(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Scale of each group of `group_size` consecutive elements of flat `values` (the last
    group zero-padded): float32 (ceil(numel / group_size),)."""
    flat = values.detach().reshape(-1).to(torch.float32)
    groups = pad_to_whole_groups(flat, group_size).view(-1, group_size)
    return scale_from_absmax(groups.abs().amax(dim=1))


def pad_to_whole_groups(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """Flat `flat` zero-padded at the end to a whole number of `group_size` groups (itself
    when it already is): the last group of every quantized stream is padded this way."""
    padding = round_up(flat.numel(), group_size) - flat.numel()
    return torch.nn.functional.pad(flat, (0, padding)) if padding else flat


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
    scales, inverse = _scales_and_inverse(values)
    return _codes(values, inverse), scales


def _scales_and_inverse(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of the quantizer over fp32 `values` (num_groups, G): each group's scale and the
    multiplier its codes use. A zero scale multiplies by zero instead, giving the exact zero
    code; NaN/Inf scales give NaN codes (zeroed in pass 2) and poison the group on decode."""
    scales = scale_from_absmax(values.abs().amax(dim=1))  # (num_groups,)
    # [Note: exact division]: the correctly rounded fp32 reciprocal, on every device.
    reciprocal = (1.0 / scales.to(torch.float64)).to(torch.float32)
    inverse = torch.where(scales == 0, torch.zeros_like(scales), reciprocal)
    return scales, inverse


def _codes(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Pass 2 of the quantizer: int8 codes (num_groups, G) of fp32 `values` (num_groups, G).
    NaN codes (from a non-finite group) become 0 so every code stays in range; the group's
    non-finite scale still decodes it to non-finite values. (``c == c`` selects the non-NaN
    codes; ``nan_to_num`` would do the same but keeps inductor from vectorizing the loop.)"""
    codes = torch.round(values * inverse[:, None])
    codes = torch.where(codes == codes, codes, torch.zeros_like(codes))
    return codes.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


class WireRow(NamedTuple):
    """Byte layout of one rank's row in one gather collective; see [Note: wire row]."""

    num_groups: int
    """Quantization groups U (with quantization off: 0, and `raw_numel` elements instead)."""
    group_size: int
    exact_numel: int
    """Exact elements E, sent in the working dtype after the codes."""
    element_size: int
    """Bytes of one working-dtype element."""
    raw_numel: int = 0
    """Without quantization: elements sent in the working dtype before the exact ones."""

    @property
    def codes_offset(self) -> int:
        return self.num_groups * SCALE_BYTES

    @property
    def exact_offset(self) -> int:
        return self.codes_offset + self.num_groups * self.group_size

    @property
    def payload_bytes(self) -> int:
        return self.exact_offset + (self.raw_numel + self.exact_numel) * self.element_size

    @property
    def row_bytes(self) -> int:
        """Payload rounded up to 4 bytes when scales are present (the next row's scales
        stay aligned); at most 3 bytes of padding."""
        if not self.num_groups:
            return self.payload_bytes
        return round_up(self.payload_bytes, SCALE_BYTES)


def row_scales(rows: torch.Tensor, row: WireRow) -> torch.Tensor:
    """fp32 scales (W, U) of wire rows `rows` (W, >= row_bytes) uint8 (a view)."""
    return rows[:, : row.codes_offset].view(torch.float32)


def row_codes(rows: torch.Tensor, row: WireRow) -> torch.Tensor:
    """int8 codes (W, U * G) of wire rows (a view)."""
    return rows[:, row.codes_offset : row.exact_offset].view(torch.int8)


def row_values(rows: torch.Tensor, row: WireRow, dtype: torch.dtype) -> torch.Tensor:
    """Working-dtype elements (W, raw_numel + exact_numel) after the codes (a view)."""
    end = row.exact_offset + (row.raw_numel + row.exact_numel) * row.element_size
    return rows[:, row.exact_offset : end].view(dtype)


def _row_groups(values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor):
    """`values` (n,) as fp32 groups (U, G) of the row, the tail of the last group zero."""
    padding = codes_out.shape[0] - values.shape[0]
    groups = torch.nn.functional.pad(values.to(torch.float32), (0, padding))
    return groups.view(scales_out.shape[0], -1)


def encode_into(values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor) -> None:
    """Quantize `values` (n,) straight into a wire row's `scales_out` (U,) fp32 and
    `codes_out` (U * G,) int8, G = U * G / U; ``n <= U * G``, the rest of the last groups is
    zero. See [Note: quantization math]; the fused kernels run the same two passes
    (:func:`encode_scales_into`, then :func:`encode_codes_into`)."""
    encode_codes_into(values, encode_scales_into(values, scales_out, codes_out), codes_out)


def encode_scales_into(
    values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor
) -> torch.Tensor:
    """Pass 1 of :func:`encode_into`: the scales into `scales_out`; returns the (U,) code
    multipliers for pass 2."""
    scales, inverse = _scales_and_inverse(_row_groups(values, scales_out, codes_out))
    scales_out.copy_(scales)
    return inverse


def encode_codes_into(values: torch.Tensor, inverse: torch.Tensor, codes_out: torch.Tensor) -> None:
    """Pass 2 of :func:`encode_into`: the int8 codes into `codes_out` (U * G,)."""
    codes_out.copy_(_codes(_row_groups(values, inverse, codes_out), inverse).view(-1))


def decode_into(scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """Decode wire rows' `scales` (W, U) fp32 and `codes` (W, U * G) int8 straight into
    `out` (W, n), any float dtype, ``n <= U * G`` (may be a strided view)."""
    world_size, num_groups = scales.shape
    values = codes.view(world_size, num_groups, -1).to(torch.float32) * scales[:, :, None]
    out.copy_(values.view(world_size, -1)[:, : out.shape[1]])


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode int8 `codes` (num_groups, group_size) with fp32 `scales` (num_groups,) to `dtype`."""
    return (codes.to(torch.float32) * scales[:, None]).to(dtype)


def quantize(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedTensor:
    """Quantize `x` (any shape; fp32, bf16 or fp16) to int8 in groups of `group_size` elements.

    The flattened tensor is split into consecutive groups; the last is padded with zeros.
    Runs on whatever device `x` lives on.
    """
    check_group_size(group_size)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} is invalid: must be one of {SUPPORTED_DTYPES}")
    flat = x.detach().reshape(-1)
    num_groups = ceil_div(flat.numel(), group_size)
    flat = pad_to_whole_groups(flat, group_size)
    codes, scales = quantize_groups(flat.view(num_groups, group_size))
    return QuantizedTensor(codes=codes, scales=scales, shape=x.shape, dtype=x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Restore a tensor of `q.shape` in `dtype` (default: the original dtype)."""
    out_dtype = q.dtype if dtype is None else dtype
    flat = dequantize_groups(q.codes, q.scales, out_dtype).reshape(-1)
    return flat[: q.numel].reshape(q.shape)
