"""DeepSpeed's quantizer op on a runner without CUDA: the harness's CPU implementation of it.

[Note: a CUDA-only subject on a CPU runner]
The upstream PR quantizes through DeepSpeed's ``CUDAQuantizer``, whose op
(``QuantizerBuilder().load()``) is a CUDA kernel: on a machine without CUDA, DeepSpeed's CPU
accelerator answers every load with "This op had not been implemented on CPU backend". Left
alone, that error would end the candidate arms as the subject's crash and every conformance
row that builds an engine as its refusal, though it says nothing about the PR.

So on a runner where ``torch.cuda.is_available()`` is false, :func:`install` puts a builder of
its own where DeepSpeed looks the op up (the ``deepspeed.ops.op_builder`` attribute, every
already imported ``deepspeed`` module that bound the CPU accelerator's not-implemented builder
under that name, and the accelerator's ``get_op_builder``). Its ``load()`` returns
:data:`CPU_OP`, this module's implementation of the op's Python interface (``quantize``,
``dequantize``, ``dequantize_fp32``, ``Symmetric``; 8-bit symmetric, the only form
``CUDAQuantizer`` asks for), written from the kernel's arithmetic ([Note: DeepSpeed's ZeRO++
scheme], evidence/zeropp.py, which the judge holds independently). The rank reports that it
was loaded, and the record and the report's first line disclose it: the verdict then covers
the PR's plumbing, not its kernel. On a GPU runner nothing is installed and the PR's own
kernel runs; ``ci/gpu-check.sh`` compares it with this one element for element.

With the CPU implementation off (``--no-cpu-quantizer``) the builder's ``load()`` raises
:class:`RunnerLacksCapability` instead: the run ends CANNOT-RUN (exit 5, "cannot run on this
runner: its quantizer needs CUDA"), never the subject's FAIL, and the conformance table
counts it as the harness's error, never a refusal. What the CPU implementation does not
cover (4-bit, asymmetric, the op's other kernels) raises the same.
"""

from __future__ import annotations

import enum
import sys
import threading
from typing import Any

import torch

OP_NAME = "quantizer"
BUILDER_NAME = "QuantizerBuilder"
WHAT_RAN = (
    "DeepSpeed's quantizer op (QuantizerBuilder, a CUDA kernel) ran as the harness's CPU "
    "implementation of it: this runner has no CUDA, so the verdict covers the PR's plumbing, "
    "not its kernel"
)


class RunnerLacksCapability(ValueError):
    """The subject needs what this runner lacks (here: its quantizer op needs CUDA). A
    ValueError, as DeepSpeed's own refusal to load the op is, so a subject that handles that
    one handles this one alike."""


class QuantType(enum.IntEnum):
    """The op's ``quantize::Type``."""

    Symmetric = 0
    Asymmetric = 1


class _Usage:
    """What this process asked of the op: counted for the rank's report."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded = 0
        self.refused = 0
        self.calls = 0

    def count(self, field: str) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + 1)


USAGE = _Usage()


def _lacks(what: str) -> RunnerLacksCapability:
    return RunnerLacksCapability(
        f"cannot run on this runner: its quantizer needs CUDA ({what}; torch sees no CUDA "
        "device here)"
    )


def _symmetric_8bit(num_bits: int, quant_type: Any) -> None:
    if int(num_bits) != 8 or int(quant_type) != QuantType.Symmetric:
        raise _lacks(
            f"the harness's CPU implementation of DeepSpeed's quantizer has the 8-bit "
            f"symmetric form only, not {num_bits}-bit {QuantType(int(quant_type)).name}"
        )


def _grouped(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """`tensor` flat as (groups, elements per group); refused where the op's kernel would
    read a partial group."""
    numel = tensor.numel()
    if groups < 1 or numel % groups:
        raise ValueError(f"quantizer op: {numel} elements do not split into {groups} equal groups")
    return tensor.reshape(groups, numel // groups)


def quantize(
    input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: Any
) -> list[torch.Tensor]:
    """``[codes, params]``: int8 codes of `input_vals`' shape and fp32 params (groups, 1), as
    the kernel computes them from fp16 input (a 2-byte input of another type is read as fp16
    bits, as the kernel reads it through ``__half*``)."""
    _symmetric_8bit(num_bits, quant_type)
    USAGE.count("calls")
    if input_vals.element_size() != 2:
        raise ValueError(
            f"quantizer op: input of dtype {input_vals.dtype}; the kernel reads fp16 (2 bytes)"
        )
    halves = input_vals.contiguous().view(torch.float16)
    values = _grouped(halves, groups).float()  # (groups, per_group), exact fp16 values
    group_max = values.abs().amax(dim=1, keepdim=True)  # (groups, 1)
    q = torch.full_like(group_max, 256.0) / (group_max + group_max)
    q = torch.where(group_max == 0, torch.ones_like(q), q)
    scaled = values * q
    scaled = torch.where(torch.isnan(scaled), torch.zeros_like(scaled), scaled)
    codes = torch.round(scaled).clamp(-128, 127).to(torch.int8)
    params = torch.ones_like(q) / q  # the stored scale
    return [codes.reshape(input_vals.shape), params]


def _dequantized(
    codes: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: Any
) -> torch.Tensor:
    _symmetric_8bit(num_bits, quant_type)
    USAGE.count("calls")
    if codes.dtype != torch.int8:
        raise ValueError(f"quantizer op: codes of dtype {codes.dtype}; the kernel reads int8")
    scale = params.reshape(-1)[:groups].float().reshape(groups, 1)
    return _grouped(codes, groups).float() * scale  # (groups, per_group) fp32 products


def dequantize(
    codes: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: Any
) -> torch.Tensor:
    """fp16 of `codes`' shape: ``fp16(fp32(code * stored scale))`` per group."""
    products = _dequantized(codes, params, groups, num_bits, quant_type)
    return products.to(torch.float16).reshape(codes.shape)


def dequantize_fp32(
    codes: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: Any
) -> torch.Tensor:
    """fp32 of `codes`' shape: ``fp32(code * stored scale)`` per group."""
    return _dequantized(codes, params, groups, num_bits, quant_type).reshape(codes.shape)


class _CpuOp:
    """The op module's Python interface, as ``QuantizerBuilder().load()`` returns it."""

    Symmetric = QuantType.Symmetric
    Asymmetric = QuantType.Asymmetric
    quantize = staticmethod(quantize)
    dequantize = staticmethod(dequantize)
    dequantize_fp32 = staticmethod(dequantize_fp32)

    def __getattr__(self, name: str) -> Any:
        raise _lacks(f"the harness's CPU implementation of DeepSpeed's quantizer has no {name}")


CPU_OP = _CpuOp()


def builder(enabled: bool) -> type:
    """A builder class standing for DeepSpeed's ``QuantizerBuilder`` on this runner: its
    ``load()`` returns :data:`CPU_OP` (`enabled`) or raises :class:`RunnerLacksCapability`."""

    class HarnessQuantizerBuilder:
        NAME = OP_NAME
        BUILD_VAR = "DS_BUILD_QUANTIZER"
        harness_cpu_implementation = enabled

        def __init__(self, name: str | None = None) -> None:
            self.name = name or OP_NAME

        def absolute_name(self) -> str:
            return f"qwz.qualify.run.quantizer_op ({OP_NAME}, the harness's CPU implementation)"

        def is_compatible(self, verbose: bool = False) -> bool:
            return enabled

        def sources(self) -> list[str]:
            return []

        def load(self, verbose: bool = True) -> Any:
            if not enabled:
                USAGE.count("refused")
                raise _lacks(
                    "DeepSpeed's QuantizerBuilder has no CPU kernel, and the harness's CPU "
                    "implementation is off (--no-cpu-quantizer)"
                )
            USAGE.count("loaded")
            return CPU_OP

        def jit_load(self, verbose: bool = True) -> Any:
            return self.load(verbose)

    return HarnessQuantizerBuilder


def needed() -> bool:
    """Whether this runner needs the stand-in: torch sees no CUDA device."""
    return not torch.cuda.is_available()


def install(enabled: bool) -> bool:
    """[Note: a CUDA-only subject on a CPU runner]: where this runner has no CUDA, make
    DeepSpeed's quantizer op lookups in this process find the harness's builder (`enabled`:
    the CPU implementation; else a refusal naming the missing capability). Returns whether it
    installed; call after ``deepspeed`` is importable from where the ranks import it."""
    if not needed():
        return False
    import deepspeed.ops.op_builder as op_builder
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    stock = accelerator.get_op_builder(BUILDER_NAME)
    replacement = builder(enabled)
    if getattr(stock, "harness_cpu_implementation", None) is not None:
        stock = getattr(stock, "stock_builder", stock)
    replacement.stock_builder = stock
    op_builder.__dict__[BUILDER_NAME] = replacement
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed") and getattr(module, BUILDER_NAME, None) is stock:
            setattr(module, BUILDER_NAME, replacement)
    lookup = type(accelerator).get_op_builder

    def get_op_builder(self: Any, class_name: str) -> Any:
        return replacement if class_name == BUILDER_NAME else lookup(self, class_name)

    accelerator.get_op_builder = get_op_builder.__get__(accelerator)
    return True


def report() -> dict[str, int]:
    """What this process asked of the stand-in: loads, refused loads, op calls."""
    return {"loaded": USAGE.loaded, "refused": USAGE.refused, "calls": USAGE.calls}


def substituted() -> list[str]:
    """The record's ``subject.substituted_ops`` as this rank saw them: :data:`WHAT_RAN` where
    the subject loaded the CPU implementation, with how often it was called."""
    if not USAGE.loaded:
        return []
    return [WHAT_RAN]


def explained(error: BaseException) -> BaseException:
    """`error` as the rank reports it: where the stand-in refused to load (or the error's
    chain holds its refusal), a :class:`RunnerLacksCapability` -- what the runner lacks, not
    what the subject did -- whatever the subject made of the refusal."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, RunnerLacksCapability):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if USAGE.refused:
        lacking = _lacks(
            "DeepSpeed's QuantizerBuilder has no CPU kernel, and the harness's "
            "CPU implementation is off (--no-cpu-quantizer)"
        )
        lacking.__cause__ = error
        return lacking
    return error
