"""Canonical parameter hashes: equal hashes mean bit-identical parameters.

The digest covers, for every parameter in name order, its name, dtype, shape and
raw bytes (copied to the CPU), so it is independent of device, of memory layout
(views into a flat buffer hash like ordinary tensors) and of registration order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def _update(digest: hashlib._Hash, name: str, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest.update(name.encode())
    digest.update(f"|{data.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes())


def tensors_hash(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 hex of (name, dtype, shape, bytes) of each tensor, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        _update(digest, name, tensor)
    return digest.hexdigest()


def param_hash(module: torch.nn.Module) -> str:
    """sha256 hex of every parameter of `module` (see the module docstring)."""
    return tensors_hash(module.named_parameters())
