"""Pure group-wise symmetric int8 quantization, and the wire format of the quantized gather.

Nothing here knows about processes or configs. This module owns the numbers every other
module relies on: :data:`DEFAULT_GROUP_SIZE`, the scale formula (:func:`scale_from_absmax`,
:func:`group_scales`), the decode error bound (:data:`DECODE_ERROR_SLACK`) and the byte
layout of one rank's wire row (:class:`WireRow`). The eager kernels (:func:`encode_into`,
:func:`decode_into`) are straight-line tensor code (no data-dependent Python branch, no
``.item()``), so ``torch.compile`` can fuse them; on CPU the fused kernels are qwz's native
one-pass C kernels (native.py), which compute the same bytes.

[Note: quantization math]
For each group of ``G`` consecutive elements, in fp32 whatever the input dtype
(never staged through fp16, so bf16 values beyond 65504 stay finite)::

    scale = absmax / 127            # fp32, correctly rounded; >= 0 (two edge cases below)
    code  = round(x * (1 / scale))  # int8 in [-127, 127]; 0 where scale == 0
    x_hat = code * scale            # fp32, then cast to the working dtype

``absmax`` maps to 127 (not 128 clamped to 127), and an all-zero group has scale 0 and
decodes to exact zeros. The code multiplies by the fp32 reciprocal of the scale instead of
dividing (a division costs 2.3x a multiply on CPU): ``fl(x * fl(1 / scale))`` differs from
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
int8 codes, then ``E`` elements that travel exactly in the working dtype (small parameters),
then at most 3 zero bytes so that the next rank's row, and with it its scales, starts 4-byte
aligned. Without quantization the row is ``[ values: U * G ][ exact: E ]`` in the working
dtype, which needs no padding. Every rank's row of one collective has the same length.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from qwz import native

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

logger = logging.getLogger("qwz")


def scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """The scale of each group from its fp32 absmax: ``absmax / 127``, zero for a zero group,
    a nonzero scale at least 2**-126, one ulp smaller where ``127 * scale`` would overflow.
    The one scale formula of qwz; see [Note: quantization math]."""
    absmax = absmax.to(torch.float32)
    scales = torch.where(
        absmax == 0, absmax, torch.clamp(absmax / INT8_MAX, min=torch.finfo(torch.float32).tiny)
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
    padding = -flat.numel() % group_size
    groups = torch.nn.functional.pad(flat, (0, padding)).view(-1, group_size)
    return scale_from_absmax(groups.abs().amax(dim=1))


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
    inverse = torch.where(scales == 0, torch.zeros_like(scales), 1.0 / scales)
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
    """Elements E sent exactly in the working dtype after the codes."""
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
        return -(-self.payload_bytes // SCALE_BYTES) * SCALE_BYTES


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


class QuantKernels(NamedTuple):
    """The wire-format kernels a gather uses: eager, or fused by ``torch.compile``."""

    name: str
    """``"eager"`` or ``"compiled"``."""
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


EAGER_KERNELS = QuantKernels("eager", encode_into, decode_into)


class _FusedKernel:
    """One kernel fused by ``torch.compile``, falling back to the eager kernel (same bytes)
    if dynamo hits its recompile limit: logged and recorded in `fallback`, never silent.

    Gathers call it with two shapes per plan (full chunk and tail), so the limit means many
    distinct plans in one process, not a kernel that recompiles every call.

    `check` (default none): asked before the first compile, returns why ``torch.compile``
    cannot serve here (None when it can); a reason also means eager from then on, logged
    and recorded in `fallback`. The process's fused kernels pass :func:`inductor_probe`, so
    the probe's compile is paid only where the native kernels do not serve.
    """

    def __init__(self, eager: Callable[..., None], check: Callable[[], str | None] | None = None):
        self.eager = eager
        self.fused = torch.compile(eager, dynamic=False)
        self.fallback: str | None = None
        self.check = check
        self._compiled: set[tuple] = set()

    def __call__(self, *args: torch.Tensor) -> None:
        if self.fallback is not None:
            return self.eager(*args)
        key = tuple(_signature(arg) for arg in args)
        if key in self._compiled:  # compiled for exactly these inputs: no recompile to watch
            return self.fused(*args)
        reason = self.check() if self.check is not None else None
        if reason is not None:
            self.fallback = f"{self.eager.__name__}: torch.compile unusable ({reason}); eager now"
            logger.warning("qwz: fused kernel %s", self.fallback)
            return self.eager(*args)
        import torch._dynamo

        # Only inputs not seen before can make dynamo compile again: they alone pay for the
        # config patch (about 20 us, as much as the call itself on small chunks).
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                result = self.fused(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            self.fallback = f"{self.eager.__name__}: recompile limit hit ({error}); eager now"
            logger.warning("qwz: fused kernel %s", self.fallback)
            return self.eager(*args)
        self._compiled.add(key)
        return result


def _signature(tensor: torch.Tensor) -> tuple:
    """What a compiled kernel is specialised on: shape, strides, dtype, device, grad mode,
    and the alignment of the data (inductor picks aligned or unaligned vector loads by it)."""
    return (
        torch.is_grad_enabled(),
        tensor.requires_grad,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.data_ptr() % 64,
    )


class _FusedDecode:
    """:func:`decode_into`, fused: the native one-pass kernel where it serves the tensors
    (CPU, bf16/fp32 destination; threads: [Note: native build]), else ``torch.compile`` on
    whole groups, the partial last group of a row (a source that is not a whole number of
    groups) decoded eagerly -- the same bytes -- which also keeps the compiled kernel clear
    of an inductor CPU bug seen in torch 2.13 (a fused copy into a partial last group left
    it unwritten)."""

    def __init__(
        self,
        native: native.NativeKernels | None = None,
        check: Callable[[], str | None] | None = None,
    ) -> None:
        self.kernel = _FusedKernel(decode_into, check)
        self.native = native

    @property
    def fallback(self) -> str | None:
        return self.kernel.fallback

    def __call__(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
        if self.native is not None and self.native.can_decode(scales, codes, out):
            return self.native.decode(scales, codes, out)
        group_size = codes.shape[1] // scales.shape[1]
        numel = out.shape[1]
        whole = numel // group_size
        if whole:
            self.kernel(
                scales[:, :whole], codes[:, : whole * group_size], out[:, : whole * group_size]
            )
        if whole * group_size < numel:
            decode_into(
                scales[:, whole : whole + 1],
                codes[:, whole * group_size : (whole + 1) * group_size],
                out[:, whole * group_size :],
            )


class _FusedEncode:
    """:func:`encode_into`, fused: the native one-pass kernel where it serves the tensors
    (CPU, contiguous fp32 source; threads: [Note: native build]), else two ``torch.compile``
    kernels, one per pass (scales, then codes).

    Fused into one kernel, inductor's CPU code for the group reduction and the broadcast
    multiply that follows it runs about 3x slower than the two kernels apart (measured,
    torch 2.13, 16M elements, one thread: 29 ms against 9 ms; a bf16 copy of the same
    buffer takes 2.6 ms). The native kernel reads each group once (8M elements, one
    thread: 2.7 ms against 4.7 ms for the two compiled passes and 2.3 ms for a bf16 copy)."""

    def __init__(
        self,
        native: native.NativeKernels | None = None,
        check: Callable[[], str | None] | None = None,
    ) -> None:
        self.scales = _FusedKernel(encode_scales_into, check)
        self.codes = _FusedKernel(encode_codes_into, check)
        self.native = native

    @property
    def fallback(self) -> str | None:
        return self.scales.fallback or self.codes.fallback

    def __call__(self, values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor):
        if self.native is not None and self.native.can_encode(values, scales_out, codes_out):
            return self.native.encode(values, scales_out, codes_out)
        self.codes(values, self.scales(values, scales_out, codes_out), codes_out)


@functools.cache
def native_kernels() -> tuple[native.NativeKernels | None, str | None]:
    """The native CPU kernels and None, or None and why they cannot serve here (logged; the
    fused kernels then use ``torch.compile`` on CPU too): they must build, load, and write
    the eager kernels' bytes on rows that take every path. See [Note: native build]."""
    try:
        kernels = native.load()
        candidate = QuantKernels("native", kernels.encode, kernels.decode)
        _probe_kernels(candidate, NATIVE_PROBE_ROWS, (torch.bfloat16, torch.float32))
        return kernels, None
    except Exception as error:  # any failure means: torch.compile instead, and say why
        reason = _first_line(error)
        logger.warning("qwz: native wire kernels unavailable (%s); torch.compile instead", reason)
        return None, reason


@functools.cache
def inductor_probe() -> str | None:
    """Why ``torch.compile`` cannot fuse the kernels here (None when it can): compiles them
    for a small CPU row and checks they write the eager kernels' bytes (on CPU this needs a
    C++ compiler). Run on first need, not at start-up: where the native kernels serve every
    call, the compile is never paid."""
    try:
        _probe_kernels(QuantKernels("compiled", _FusedEncode(), _FusedDecode()))
    except Exception as error:  # any failure means: eager, and say why
        return _first_line(error)
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@functools.cache
def compiled_kernels() -> QuantKernels:
    """The same kernels fused: native one-pass kernels on CPU where they build, else
    ``torch.compile`` (compiled on first use, per shape)."""
    kernels, _ = native_kernels()
    return QuantKernels(
        "compiled", _FusedEncode(kernels, inductor_probe), _FusedDecode(kernels, inductor_probe)
    )


def kernel_fallbacks() -> list[str]:
    """Recompile-limit fallbacks of the fused kernels in this process (empty when none)."""
    if compiled_kernels.cache_info().currsize == 0:
        return []
    kernels = compiled_kernels()
    return [k.fallback for k in (kernels.encode, kernels.decode) if k.fallback is not None]


PROBE_ROWS = ((8, 4, 5),)
"""(group size, groups, elements short of whole groups) of the rows a probe encodes."""
NATIVE_PROBE_ROWS = ((64, 17, 5), (1000, 17, 5), (8, 3, 5), (100, 2, 150))
"""Rows taking every path of the native kernels: blocks of 16 groups at the G=64 fast path,
a block of groups too large to share L1 (encoded one at a time), partial blocks, any other
group size, and a group wholly past the source's end."""


def _probe_values(group_size: int, numel: int) -> torch.Tensor:
    """A ramp; with two groups or more, a zero first group and a second that holds 127 (scale
    1) and the ties 2.5 and -3.5 (codes 2 and -4: half to even)."""
    values = torch.linspace(-3.0, 5.0, numel)
    if numel >= 2 * group_size and group_size >= 3:
        values[:group_size] = 0.0
        values[group_size : group_size + 3] = torch.tensor([127.0, 2.5, -3.5])
    return values


def _probe_kernels(
    kernels: QuantKernels,
    rows: tuple[tuple[int, int, int], ...] = PROBE_ROWS,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> None:
    """Run `kernels` on `rows`, decoding into each of `dtypes`, and require the eager
    kernels' bytes."""
    for group_size, num_groups, short in rows:
        values = _probe_values(group_size, num_groups * group_size - short)
        layout = WireRow(num_groups, group_size, exact_numel=0, element_size=4)
        for dtype in dtypes:
            written = []
            for candidate in (EAGER_KERNELS, kernels):
                row = torch.zeros(1, layout.row_bytes, dtype=torch.uint8)
                candidate.encode(values, row_scales(row, layout)[0], row_codes(row, layout)[0])
                decoded = torch.empty(1, values.numel(), dtype=dtype)
                candidate.decode(row_scales(row, layout), row_codes(row, layout), decoded)
                written.append((row, decoded))
            (eager_row, eager_decoded), (row, decoded) = written
            if not (torch.equal(eager_row, row) and torch.equal(eager_decoded, decoded)):
                raise RuntimeError(
                    f"{kernels.name} kernels do not reproduce the eager kernels' bytes "
                    f"(G={group_size}, {num_groups} groups, {dtype})"
                )


@functools.cache
def compile_probe() -> str | None:
    """Why the fused kernels cannot serve here (None when they can): the native kernels
    build and pass their probe (:func:`native_kernels`), or else ``torch.compile`` passes
    :func:`inductor_probe`. With the native kernels, calls they do not serve (other
    devices, dtypes, thread counts) still probe ``torch.compile`` before its first use and
    run eager, logged and recorded, where it fails."""
    kernels, native_reason = native_kernels()
    if kernels is not None:
        return None
    inductor_reason = inductor_probe()
    if inductor_reason is None:
        return None
    return f"native kernels: {native_reason}; torch.compile: {inductor_reason}"


def compile_available() -> bool:
    """Whether the fused kernels work here (see :func:`compile_probe`)."""
    return compile_probe() is None


class KernelChoice(NamedTuple):
    """Which kernels a gather uses, and why."""

    kernels: QuantKernels
    fallback_reason: str | None
    """Why the fused kernels were not used although wanted (None when they were, or when
    eager was asked for)."""


def choose_kernels(compile_kernels: bool | None) -> KernelChoice:
    """Kernels for `compile_kernels`: True fused (raise if they do not work), False eager,
    None (the default) fused when the probe passes, else eager with the reason logged."""
    if compile_kernels is False:
        return KernelChoice(EAGER_KERNELS, None)
    reason = compile_probe()
    if reason is None:
        return KernelChoice(compiled_kernels(), None)
    if compile_kernels:
        raise RuntimeError(f"compile_kernels=True but the fused kernels fail here: {reason}")
    logger.warning("qwz: fused kernels unavailable (%s); using eager kernels", reason)
    return KernelChoice(EAGER_KERNELS, reason)


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
