"""Which wire kernels a gather runs, and the process-wide state behind that choice.

quant.py holds the math and the eager kernels; this module decides when the fused ones serve
instead: qwz's native one-pass C kernels on CPU (native.py), else the eager kernels fused by
``torch.compile``. Every fused kernel must write the eager kernels' bytes, so each is checked
before it serves: the native kernels once, when they load; the ``torch.compile`` kernels by a
self-test on the device and the dtype of the call, before their first call there
(:func:`self_test_on`). Nothing is probed at import: a process whose gathers the native
kernels serve never pays a compile.

[Note: compile cache per environment]
Inductor's FX graph and AOTAutograd caches (under ``$TORCHINDUCTOR_CACHE_DIR``, default
``<tmp>/torchinductor_<user>``) key a compiled graph by the torch version, the device and
inductor's settings, but not by the vector capability ATen dispatches to
(``ATEN_CPU_CAPABILITY``, which inductor's C++ code generation also reads) nor by oneDNN's
ISA cap: a process capped at AVX2 loaded a graph compiled by a native AVX-512 process and
computed wrong values (a gradient norm of 2.21 instead of 2.97). Before qwz's first
``torch.compile`` (:func:`torch_compile`), :func:`compile_cache` appends a fingerprint of
everything that changes generated code or numerics (:func:`environment_facts`) to
``torch.compiler.config.cache_key_tag``, which both caches hash into every key (torch 2.13:
``FxGraphHashDetails.cache_key_tag``, inherited by ``AOTAutogradCacheDetails``). The tag is
read whenever a key is computed, so it also covers graphs compiled before qwz was imported,
and it keeps whatever directory the user chose: ``$TORCHINDUCTOR_CACHE_DIR`` is never
changed, only recorded (:class:`CompileCache`). Inductor's other caches are keyed by their
content (generated source, compiler command line with its ISA flags), and qwz's own native
build cache by the source, flags, compiler and CPU flags ([Note: native build]).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from qwz import native
from qwz.quant import (
    SUPPORTED_DTYPES,
    WireRow,
    decode_into,
    encode_codes_into,
    encode_into,
    encode_scales_into,
    row_codes,
    row_scales,
)
from qwz.sizes import ceil_div

logger = logging.getLogger("qwz")


class QuantKernels(NamedTuple):
    """The wire-format kernels a gather uses: eager, or fused."""

    name: str
    """``"eager"``, ``"compiled"`` or ``"native"``."""
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


EAGER_KERNELS = QuantKernels("eager", encode_into, decode_into)

# --------------------------------------------------------------------------- #
# The compile cache ([Note: compile cache per environment])
# --------------------------------------------------------------------------- #

ISA_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
)
"""Environment variables that cap or pick the vector instructions of ATen, inductor's C++
code, oneDNN or MKL."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment_facts() -> dict[str, str]:
    """What the code ``torch.compile`` generates, or the numbers it computes, depend on
    beyond what inductor keys itself: ATen's CPU capability, the ISA variables
    (:data:`ISA_ENV_VARS`), the CPU and its feature flags, torch (with its git revision),
    CUDA, Triton and Python versions. No CUDA call: the device's own properties are in
    inductor's key already."""
    facts = {
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "cpu_flags": " ".join(sorted(native.cpu_flags())),
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "python": sys.version.split()[0],
    }
    for name in ISA_ENV_VARS:
        facts[name] = os.environ.get(name, "").strip().lower()
    return facts


def environment_fingerprint(facts: dict[str, str] | None = None) -> str:
    """16 hex digits naming `facts` (default: :func:`environment_facts`)."""
    facts = environment_facts() if facts is None else facts
    text = "\0".join(f"{key}={facts[key]}" for key in sorted(facts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CompileCache(NamedTuple):
    """The inductor cache this process compiles into, and how its keys are made distinct."""

    directory: str
    """Inductor's cache directory (never changed by qwz)."""
    directory_source: str
    """``"TORCHINDUCTOR_CACHE_DIR"`` (set before qwz's first compile) or ``"inductor's
    default"``."""
    fingerprint: str
    """:func:`environment_fingerprint` of this process."""
    cache_key_tag: str
    """``torch.compiler.config.cache_key_tag`` after qwz appended the fingerprint."""


@functools.cache
def compile_cache() -> CompileCache:
    """Key inductor's caches by this environment (once per process, before qwz's first
    compile; see [Note: compile cache per environment]) and say which cache is in use."""
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    fingerprint = environment_fingerprint()
    marker = f"qwz-env-{fingerprint}"
    tag = torch.compiler.config.cache_key_tag
    if marker not in tag:
        tag = f"{tag}+{marker}" if tag else marker
        torch.compiler.config.cache_key_tag = tag
    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.abspath(cache_dir_utils.default_cache_dir())
    directory = default if explicit is None else os.path.abspath(explicit)
    cache = CompileCache(
        directory=directory,
        directory_source="inductor's default"
        if directory == default
        else "TORCHINDUCTOR_CACHE_DIR",
        fingerprint=fingerprint,
        cache_key_tag=tag,
    )
    logger.info("qwz: torch.compile cache %s (%s), keys tagged %s", *cache[:2], marker)
    return cache


def torch_compile(function: Callable, **options) -> Callable:
    """``torch.compile(function, **options)`` with the cache keyed first: every qwz kernel
    compiles through here."""
    compile_cache()
    return torch.compile(function, **options)


# --------------------------------------------------------------------------- #
# Fused kernels
# --------------------------------------------------------------------------- #

SelfTest = Callable[[torch.device, torch.dtype], "str | None"]
"""Why the fused kernels cannot serve calls on this device into this dtype (None: they can)."""


class _FusedKernel:
    """One kernel fused by ``torch.compile``, falling back to the eager kernel (same bytes)
    if dynamo hits its recompile limit: logged and recorded in `fallback`, never silent.

    Gathers call it with two shapes per plan (full chunk and tail), so the limit means many
    distinct plans in one process, not a kernel that recompiles every call.

    `check` (default none): asked with the call's device and dtype (`device_dtype` picks
    them from the arguments) before each first compile, returns why ``torch.compile``
    cannot serve there (None when it can); a reason also means eager from then on, logged
    and recorded in `fallback`. The process's fused kernels check with :func:`self_test_on`.
    """

    def __init__(
        self,
        eager: Callable[..., None],
        check: SelfTest | None = None,
        device_dtype: Callable[..., tuple[torch.device, torch.dtype]] | None = None,
    ):
        self.eager = eager
        self.fused = torch_compile(eager, dynamic=False)
        self.fallback: str | None = None
        self.check = check
        self.device_dtype = device_dtype or (lambda first, *_: (first.device, first.dtype))
        self._compiled: set[tuple] = set()

    def __call__(self, *args: torch.Tensor) -> None:
        if self.fallback is not None:
            return self.eager(*args)
        key = tuple(_signature(arg) for arg in args)
        if key in self._compiled:  # compiled for exactly these inputs: no recompile to watch
            return self.fused(*args)
        reason = self.check(*self.device_dtype(*args)) if self.check is not None else None
        if reason is not None:
            self.fallback = f"{self.eager.__name__}: torch.compile unusable ({reason}); eager now"
            logger.warning("qwz: fused kernel %s", self.fallback)
            return self.eager(*args)
        import torch._dynamo

        # Only inputs not seen before can make dynamo compile again: they alone pay for the
        # config patch, whose cost is comparable to the call itself on small chunks.
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


def _encode_device_dtype(values: torch.Tensor, *_: torch.Tensor):
    """The self-test an encode needs: its device, fp32 sources (the masters) decoded to fp32."""
    return values.device, torch.float32


def _decode_device_dtype(scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor):
    """The self-test a decode needs: its device and destination dtype."""
    return out.device, out.dtype


class _FusedDecode:
    """:func:`decode_into`, fused: the native one-pass kernel where it serves the tensors
    (CPU, bf16/fp32 destination; threads: [Note: native build]), else ``torch.compile`` on
    whole groups, the partial last group of a row (a source that is not a whole number of
    groups) decoded eagerly -- the same bytes -- which also keeps the compiled kernel clear
    of an inductor CPU bug seen in torch 2.13 (a fused copy into a partial last group left
    it unwritten)."""

    def __init__(
        self, native: native.NativeKernels | None = None, check: SelfTest | None = None
    ) -> None:
        self.kernel = _FusedKernel(decode_into, check, _decode_device_dtype)
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
    kernels, one per pass (scales, then codes): fused into one kernel, inductor's CPU code
    for the group reduction and the broadcast multiply after it runs several times slower
    than the two kernels apart (torch 2.13). The native kernel reads each group once."""

    def __init__(
        self, native: native.NativeKernels | None = None, check: SelfTest | None = None
    ) -> None:
        self.scales = _FusedKernel(encode_scales_into, check, _encode_device_dtype)
        self.codes = _FusedKernel(encode_codes_into, check, _encode_device_dtype)
        self.native = native

    @property
    def fallback(self) -> str | None:
        return self.scales.fallback or self.codes.fallback

    def __call__(self, values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor):
        if self.native is not None and self.native.can_encode(values, scales_out, codes_out):
            return self.native.encode(values, scales_out, codes_out)
        self.codes(values, self.scales(values, scales_out, codes_out), codes_out)


def _torch_kernels() -> QuantKernels:
    """Fresh ``torch.compile`` kernels, no native path and no self-test of their own."""
    return QuantKernels("compiled", _FusedEncode(), _FusedDecode())


# --------------------------------------------------------------------------- #
# Self-tests: fused kernels must write the eager kernels' bytes
# --------------------------------------------------------------------------- #

RAMP_ROWS = ((8, 4, 5), (64, 3, 0))
"""(group size, groups, elements short of whole groups) of ramp rows :func:`compare_with_eager`
encodes besides the row of extremes (the only row of :func:`self_test_on`)."""
NATIVE_SELF_TEST_ROWS = ((64, 17, 5), (1000, 17, 5), (8, 3, 5), (100, 2, 150))
"""Rows taking every path of the native kernels: blocks of 16 groups at the G=64 fast path,
a block of groups too large to share L1 (encoded one at a time), partial blocks, any other
group size, and a group wholly past the source's end."""
EXTREMES_GROUP_SIZE = 8


def ramp_values(group_size: int, numel: int) -> torch.Tensor:
    """A ramp; with two groups or more, a zero first group and a second that holds 127 (scale
    1) and the ties 2.5 and -3.5 (codes 2 and -4: half to even)."""
    values = torch.linspace(-3.0, 5.0, numel)
    if numel >= 2 * group_size and group_size >= 3:
        values[:group_size] = 0.0
        values[group_size : group_size + 3] = torch.tensor([127.0, 2.5, -3.5])
    return values


def extreme_values() -> torch.Tensor:
    """fp32 groups of :data:`EXTREMES_GROUP_SIZE` at the edges of the scale formula: zeros,
    negative zeros, subnormals only (the 2**-126 floor), the largest finite values (the
    overflow step), mixed signs and magnitudes, a group just above the floor, and ties of
    the code rounding. Finite only: NaN payloads differ between CPU and CUDA arithmetic."""
    tiny, largest = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    smallest = 2.0**-149
    groups = [
        [0.0] * 8,
        [-0.0] * 8,
        [smallest, -smallest, tiny / 2, -tiny / 4, 3 * smallest, 0.0, -0.0, tiny * (1 - 2**-23)],
        [largest, -largest, largest / 3, -1.0, 0.0, largest / 127, -largest / 254, 1e30],
        [largest, largest, largest, largest, -largest, -largest, largest, -largest],
        [1.0, -1.0, 0.5, -0.25, 1e-30, -1e30, 3.0e-39, 127.0],
        [tiny * 127, tiny * 200, -tiny, tiny * 63.5, 0.0, -tiny * 127, tiny, tiny * 1.5],
        [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 125.5],
        [1e-40, -1e-38, 2e-38, -5e-39, 1e-45, 0.0, 7e-39, -3e-38],
        [3.0, -7.0, 1.0e-7, 65504.0, -65520.0, 3.4e38, -1.2e-38, 9.9e37],
    ]
    return torch.tensor(groups, dtype=torch.float32).reshape(-1)


def _self_test_cases(rows):
    """(values, group size, groups) of every self-test row: a ramp per entry of `rows`, then
    one row of :func:`extreme_values` followed by a ramp with ties and a partial last group
    (one shape, so a self-test adds one compile per kernel)."""
    for group_size, num_groups, short in rows:
        yield ramp_values(group_size, num_groups * group_size - short), group_size, num_groups
    values = torch.cat([extreme_values(), ramp_values(EXTREMES_GROUP_SIZE, 27)])
    yield values, EXTREMES_GROUP_SIZE, ceil_div(values.numel(), EXTREMES_GROUP_SIZE)


def _written(kernels: QuantKernels, values, group_size, num_groups, dtype, device):
    """The wire row `kernels` encode `values` into and what they decode it to, both on
    `device`, as CPU tensors."""
    layout = WireRow(num_groups, group_size, exact_numel=0, element_size=4)
    row = torch.zeros(1, layout.row_bytes, dtype=torch.uint8, device=device)
    kernels.encode(values.to(device), row_scales(row, layout)[0], row_codes(row, layout)[0])
    decoded = torch.empty(1, values.numel(), dtype=dtype, device=device)
    kernels.decode(row_scales(row, layout), row_codes(row, layout), decoded)
    return row.cpu(), decoded.cpu()


class KernelMismatch(NamedTuple):
    """One self-test row where two kernels wrote different bytes."""

    against: str
    """The reference: ``"eager on cpu"`` or ``"eager on <device>"``."""
    group_size: int
    num_groups: int
    dtype: torch.dtype
    row_bytes_differ: int
    """Bytes of the wire row that differ."""
    decoded_differ: int
    """Decoded elements whose bytes differ."""


class KernelComparison(NamedTuple):
    """:func:`compare_with_eager`'s report: the rows checked and every mismatch."""

    device: str
    dtype: torch.dtype
    kernels: str
    rows_checked: int
    mismatches: tuple[KernelMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def compare_with_eager(
    device: torch.device | str,
    dtype: torch.dtype,
    kernels: QuantKernels | None = None,
    rows: tuple[tuple[int, int, int], ...] = RAMP_ROWS + NATIVE_SELF_TEST_ROWS,
) -> KernelComparison:
    """Bytes of `kernels` (default: fresh ``torch.compile`` kernels, native ones off) on
    `device`, encoding fp32 rows and decoding into `dtype`, against the eager kernels on the
    CPU (the bytes every rank must agree on) and, on another device, the eager kernels
    there (eager CUDA must match the CPU too). Rows: ramps of `rows` and
    :func:`extreme_values`. Raises what the kernels raise (a failed compile)."""
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is invalid: must be one of {SUPPORTED_DTYPES}")
    kernels = _torch_kernels() if kernels is None else kernels
    references = [("eager on cpu", torch.device("cpu"))]
    if device.type != "cpu":
        references.append((f"eager on {device}", device))
    mismatches, checked = [], 0
    for values, group_size, num_groups in _self_test_cases(rows):
        checked += 1
        row, decoded = _written(kernels, values, group_size, num_groups, dtype, device)
        for name, where in references:
            expected_row, expected = _written(
                EAGER_KERNELS, values, group_size, num_groups, dtype, where
            )
            row_differ = int((row != expected_row).sum())
            decoded_differ = int((decoded.view(torch.uint8) != expected.view(torch.uint8)).sum())
            if row_differ or decoded_differ:
                mismatches.append(
                    KernelMismatch(name, group_size, num_groups, dtype, row_differ, decoded_differ)
                )
    return KernelComparison(str(device), dtype, kernels.name, checked, tuple(mismatches))


def _require_eager_bytes(report: KernelComparison) -> None:
    if not report.ok:
        first = report.mismatches[0]
        raise RuntimeError(
            f"{report.kernels} kernels on {report.device} do not reproduce the eager kernels' "
            f"bytes ({first.against}: G={first.group_size}, {first.num_groups} groups, "
            f"{first.dtype}; {len(report.mismatches)} of {report.rows_checked} rows differ)"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@functools.cache
def self_test_on(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch.compile`` cannot serve wire kernels on `device` decoding into `dtype`
    (None when it can): fresh compiled kernels encode fp32 self-test rows there and decode
    them into `dtype`, and must write the CPU eager kernels' bytes (on CPU this also needs a
    C++ compiler). Once per device and dtype, before the first compiled call there."""
    try:
        _require_eager_bytes(compare_with_eager(device, dtype, rows=()))
    except Exception as error:  # any failure means: eager there, and say why
        return _first_line(error)
    return None


# --------------------------------------------------------------------------- #
# Process-wide kernels and the choice
# --------------------------------------------------------------------------- #


@functools.cache
def native_kernels() -> tuple[native.NativeKernels | None, str | None]:
    """The native CPU kernels and None, or None and why they cannot serve here (logged; the
    fused kernels then use ``torch.compile`` on CPU too): they must build, load, and write
    the eager kernels' bytes on rows that take every path. See [Note: native build]."""
    try:
        kernels = native.load()
        candidate = QuantKernels("native", kernels.encode, kernels.decode)
        for dtype in (torch.bfloat16, torch.float32):
            _require_eager_bytes(
                compare_with_eager("cpu", dtype, candidate, rows=NATIVE_SELF_TEST_ROWS)
            )
        return kernels, None
    except Exception as error:  # any failure means: torch.compile instead, and say why
        reason = _first_line(error)
        logger.warning("qwz: native wire kernels unavailable (%s); torch.compile instead", reason)
        return None, reason


@functools.cache
def compiled_kernels() -> QuantKernels:
    """The process's fused kernels: native one-pass kernels on CPU where they build and
    serve the call, else ``torch.compile`` (compiled on first use, per shape, after
    :func:`self_test_on` passes for the call's device and dtype)."""
    kernels, _ = native_kernels()
    return QuantKernels(
        "compiled", _FusedEncode(kernels, self_test_on), _FusedDecode(kernels, self_test_on)
    )


def kernel_fallbacks() -> list[str]:
    """Fallbacks of the process's fused kernels to eager (empty when none)."""
    if compiled_kernels.cache_info().currsize == 0:
        return []
    kernels = compiled_kernels()
    return [k.fallback for k in (kernels.encode, kernels.decode) if k.fallback is not None]


def self_test(device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16):
    """Why the fused kernels cannot serve gathers on `device` (default: the CPU) into
    `dtype` (None when they can). On CPU: the native kernels build and pass their self-test
    (:func:`native_kernels`), or else ``torch.compile`` passes :func:`self_test_on`; calls
    the native kernels do not serve (dtypes, thread counts) still run :func:`self_test_on`
    before their first compile, and eager, logged and recorded, where it fails. On any other
    device: :func:`self_test_on` there."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu":
        kernels, native_reason = native_kernels()
        if kernels is not None:
            return None
        reason = self_test_on(device, dtype)
        return (
            None if reason is None else f"native kernels: {native_reason}; torch.compile: {reason}"
        )
    reason = self_test_on(device, dtype)
    return None if reason is None else f"torch.compile on {device}: {reason}"


def compile_available() -> bool:
    """Whether the fused kernels work here (see :func:`self_test`)."""
    return self_test() is None


class KernelChoice(NamedTuple):
    """Which kernels a gather uses, and why."""

    kernels: QuantKernels
    fallback_reason: str | None
    """Why the fused kernels were not used although wanted (None when they were, or when
    eager was asked for)."""


def choose_kernels(
    compile_kernels: bool | None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> KernelChoice:
    """Kernels for `compile_kernels`: True fused (raise if they do not work), False eager,
    None (the default) fused when :func:`self_test` passes for the gather's `device` and
    working `dtype` (default: the CPU), else eager with the reason logged."""
    if compile_kernels is False:
        return KernelChoice(EAGER_KERNELS, None)
    reason = self_test(device, dtype)
    if reason is None:
        return KernelChoice(compiled_kernels(), None)
    if compile_kernels:
        raise RuntimeError(f"compile_kernels=True but the fused kernels fail here: {reason}")
    logger.warning("qwz: fused kernels unavailable (%s); using eager kernels", reason)
    return KernelChoice(EAGER_KERNELS, reason)
