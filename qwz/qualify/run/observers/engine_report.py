"""What the engine reports about itself, outside the seam: which wire kernels it ran (read
from the optimizer's public ``kernels`` attributes, so stock DeepSpeed reports none) and which
parameters hold a non-finite value."""

from __future__ import annotations

from typing import Any

import torch

from qwz import kernels


def kernels_used(engine: Any, rank: int) -> dict[str, Any]:
    """What wire kernels this rank's arm ran, and every implementation dropped on the way
    (the record's ``KernelUse``). Reads the optimizer's public ``kernels`` /
    ``kernel_fallback`` (qwz's engine) or those of its ``qwz`` state (the DeepSpeed
    drop-in, [Note: drop-in state]); stock DeepSpeed runs none of qwz's kernels."""
    optimizer = engine.optimizer
    holder = getattr(optimizer, "qwz", optimizer)
    chosen = getattr(holder, "kernels", None)
    fallback = getattr(holder, "kernel_fallback", None)
    name = getattr(chosen, "name", None)
    fallbacks = [f"fused kernels unusable, eager instead: {fallback}"] if fallback else []
    native = False
    if name == "fused":  # the fused kernels' probes ran: asking costs nothing now
        native_kernels, native_reason = kernels.native_kernels()
        native = native_kernels is not None
        if native_reason:
            fallbacks.append(f"native kernels dropped, torch.compile instead: {native_reason}")
        fallbacks += [f"fused kernel dropped: {reason}" for reason in kernels.kernel_fallbacks()]
    return {"rank": rank, "kernels": name, "native": native, "fallbacks": fallbacks}


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or Inf on this rank."""
    return [
        name
        for name, param in module.named_parameters()
        if not bool(torch.isfinite(param.detach()).all())
    ]
