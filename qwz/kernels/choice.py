"""The process's fused kernels, and the choice a gather makes between them and the eager ones.

quant.py holds the math and the eager kernels; this module decides when the fused ones serve
instead (``"fused"``): qwz's native one-pass C kernels on CPU (native.py), else the eager
kernels fused by ``torch.compile``. Every fused kernel must write the eager kernels' bytes, so
each is checked before it serves: the native kernels once, when they load
(:func:`native_kernels`); the ``torch.compile`` kernels by a self-test on the device and the
dtype of the call, before their first call there (:func:`~qwz.kernels.self_tests.self_test_on`).
Nothing is probed at import: a process whose gathers the native kernels serve never pays a
compile."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from qwz import native
from qwz.kernels.fused import EAGER_KERNELS, FusedDecode, FusedEncode, QuantKernels
from qwz.kernels.self_tests import (
    NATIVE_SELF_TEST_ROWS,
    compare_with_eager,
    first_line,
    require_eager_bytes,
    self_test_on,
)

logger = logging.getLogger("qwz")


@functools.cache
def native_kernels() -> tuple[native.NativeKernels | None, str | None]:
    """The native CPU kernels and None, or None and why they cannot serve here (logged; the
    fused kernels then use ``torch.compile`` on CPU too): they must build, load, and write
    the eager kernels' bytes on rows that take every path. See [Note: native build]."""
    try:
        kernels = native.load()
        candidate = QuantKernels("native", kernels.encode, kernels.decode)
        for dtype in (torch.bfloat16, torch.float32):
            require_eager_bytes(
                compare_with_eager("cpu", dtype, candidate, rows=NATIVE_SELF_TEST_ROWS)
            )
        return kernels, None
    except Exception as error:  # any failure means: torch.compile instead, and say why
        reason = first_line(error)
        logger.warning("qwz: native wire kernels unavailable (%s); torch.compile instead", reason)
        return None, reason


@functools.cache
def fused_kernels() -> QuantKernels:
    """The process's fused kernels: native one-pass kernels on CPU where they build and
    serve the call, else ``torch.compile`` (compiled on first use, per shape, after
    :func:`self_test_on` passes for the call's device and dtype)."""
    kernels, _ = native_kernels()
    return QuantKernels(
        "fused", FusedEncode(kernels, self_test_on), FusedDecode(kernels, self_test_on)
    )


def kernel_fallbacks() -> list[str]:
    """Fallbacks of the process's fused kernels to eager (empty when none)."""
    if fused_kernels.cache_info().currsize == 0:
        return []
    kernels = fused_kernels()
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


def fused_available() -> bool:
    """Whether the fused kernels work here (see :func:`self_test`)."""
    return self_test() is None


class KernelChoice(NamedTuple):
    """Which kernels a gather uses, and why."""

    kernels: QuantKernels
    fallback_reason: str | None
    """Why the fused kernels were not used although wanted (None when they were, or when
    eager was asked for)."""


def choose_kernels(
    fused: bool | None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> KernelChoice:
    """Kernels for `fused` (the engine's ``fused_kernels=``): True fused (raise if they do not
    work), False eager, None (the default) fused when :func:`self_test` passes for the
    gather's `device` and working `dtype` (default: the CPU), else eager with the reason
    logged."""
    if fused is False:
        return KernelChoice(EAGER_KERNELS, None)
    reason = self_test(device, dtype)
    if reason is None:
        return KernelChoice(fused_kernels(), None)
    if fused:
        raise RuntimeError(f"fused_kernels=True but the fused kernels fail here: {reason}")
    logger.warning("qwz: fused kernels unavailable (%s); using eager kernels", reason)
    return KernelChoice(EAGER_KERNELS, reason)
