"""The wire kernels a gather runs: the eager ones (quant.py) and the fused ones, qwz's native
one-pass C kernels on CPU (native.py) where they serve the call, else the eager kernels fused by
``torch.compile`` (each checked by a self-test before its first compile: self_tests.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from qwz import native
from qwz.kernels.compile_cache import torch_compile
from qwz.quant import decode_into, encode_codes_into, encode_into, encode_scales_into

logger = logging.getLogger("qwz")


class QuantKernels(NamedTuple):
    """The wire-format kernels a gather uses: eager, or fused."""

    name: str
    """``"eager"``, ``"fused"`` or ``"native"`` (the native kernels alone, in their
    self-test)."""
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


EAGER_KERNELS = QuantKernels("eager", encode_into, decode_into)


SelfTest = Callable[[torch.device, torch.dtype], "str | None"]
"""Why the fused kernels cannot serve calls on this device into this dtype (None: they can)."""


class FusedKernel:
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
        self.fallback: str | None = None
        self.check = check
        self.device_dtype = device_dtype or (lambda first, *_: (first.device, first.dtype))
        self._compiled: set[tuple] = set()

    @functools.cached_property
    def fused(self) -> Callable[..., None]:
        """The eager kernel under ``torch.compile``, wrapped at its first call: the wrapper
        imports dynamo's and inductor's compiler (about 1.5 s of CPU per process), which a
        process whose calls the native kernels serve never needs."""
        return torch_compile(self.eager, dynamic=False)

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


class FusedDecode:
    """:func:`decode_into`, fused: the native one-pass kernel where it serves the tensors
    (CPU, bf16/fp32 destination; threads: [Note: native build]), else ``torch.compile`` on
    whole groups, the partial last group of a row (a source that is not a whole number of
    groups) decoded eagerly -- the same bytes -- which also keeps the compiled kernel clear
    of an inductor CPU bug seen in torch 2.13 (a fused copy into a partial last group left
    it unwritten)."""

    def __init__(
        self, native: native.NativeKernels | None = None, check: SelfTest | None = None
    ) -> None:
        self.kernel = FusedKernel(decode_into, check, _decode_device_dtype)
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


class FusedEncode:
    """:func:`encode_into`, fused: the native one-pass kernel where it serves the tensors
    (CPU, contiguous fp32 source; threads: [Note: native build]), else two ``torch.compile``
    kernels, one per pass (scales, then codes): fused into one kernel, inductor's CPU code
    for the group reduction and the broadcast multiply after it runs several times slower
    than the two kernels apart (torch 2.13). The native kernel reads each group once."""

    def __init__(
        self, native: native.NativeKernels | None = None, check: SelfTest | None = None
    ) -> None:
        self.scales = FusedKernel(encode_scales_into, check, _encode_device_dtype)
        self.codes = FusedKernel(encode_codes_into, check, _encode_device_dtype)
        self.native = native

    @property
    def fallback(self) -> str | None:
        return self.scales.fallback or self.codes.fallback

    def __call__(self, values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor):
        if self.native is not None and self.native.can_encode(values, scales_out, codes_out):
            return self.native.encode(values, scales_out, codes_out)
        self.codes(values, self.scales(values, scales_out, codes_out), codes_out)


def torch_kernels() -> QuantKernels:
    """Fresh ``torch.compile`` kernels, no native path and no self-test of their own."""
    return QuantKernels("fused", FusedEncode(), FusedDecode())
