"""The quantization scale each element of a qwz engine's parameter was decoded with, read
back from the working copy: what the multi-rank tests bound a decode error by."""

from __future__ import annotations

import torch

import qwz
from qwz.quant import group_scales


def element_scales(optimizer: qwz.ZeroOptimizer, param_name: str) -> torch.Tensor:
    """The scale of the group each element of `param_name` belongs to, as implied by the
    current working copy (absmax / 127); zeros where it travels exactly."""
    for region in optimizer.regions:
        for slot in region.layout.slots:
            if slot.name != param_name:
                continue
            if not region.quantize:
                return torch.zeros(slot.shape, dtype=torch.float32, device=optimizer.device)
            size = optimizer.group_size
            first, last = slot.offset // size, (slot.end - 1) // size + 1
            working = region.working[first * size : last * size]
            scales = group_scales(working, size).repeat_interleave(size)
            local = slot.offset - first * size
            return scales[local : local + slot.numel].view(slot.shape)
    raise KeyError(f"{param_name}: not a parameter of this optimizer")
