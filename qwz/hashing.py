"""Canonical parameter hashes: equal hashes mean bit-identical parameters.

The digest covers, for every parameter in name order, its name, dtype, shape and
raw bytes (copied to the CPU), so it is independent of device, of memory layout
(views into a flat buffer hash like ordinary tensors) and of registration order.

Each tensor is read once however many digests take it (:func:`tensors_hashes`): at most one
copy to the host (none for a contiguous CPU tensor), whose bytes every digest reads in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def _update(digests: list[hashlib._Hash], name: str, tensor: torch.Tensor) -> None:
    """Feed `tensor` to every digest of `digests` (one host copy, then its bytes in place)."""
    data = tensor.detach().contiguous().to("cpu").reshape(-1)
    header = name.encode() + f"|{data.dtype}|{tuple(tensor.shape)}|".encode()
    payload = data.view(torch.uint8).numpy()
    for digest in digests:
        digest.update(header)
        digest.update(payload)


def tensors_hashes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], subsets: Mapping[str, str]
) -> tuple[str, dict[str, str]]:
    """In one pass over `named_tensors`: the :func:`tensors_hash` of them all, and per
    subset the :func:`tensors_hash` of the tensors whose name `subsets` maps to it (a name
    it does not map is in no subset)."""
    whole = hashlib.sha256()
    by_subset = {subset: hashlib.sha256() for subset in sorted(set(subsets.values()))}
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        subset = subsets.get(name)
        _update([whole] if subset is None else [whole, by_subset[subset]], name, tensor)
    return whole.hexdigest(), {subset: d.hexdigest() for subset, d in by_subset.items()}


def tensors_hash(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 hex of (name, dtype, shape, bytes) of each tensor, in name order."""
    return tensors_hashes(named_tensors, {})[0]


def param_hash(module: torch.nn.Module) -> str:
    """sha256 hex of every parameter of `module` (see the module docstring)."""
    return tensors_hash(module.named_parameters())
