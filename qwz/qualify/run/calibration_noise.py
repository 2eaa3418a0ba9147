"""The calibration arm's noise ([Note: learning margin], qualify/evidence/rules/learning.py): after
every step, uniform noise in [-scale/2, scale/2] per group of the working copy of every
quantized parameter, drawn where the parameter lives.

[Note: calibration noise on the device]
The noise is drawn on the parameters' device, a bounded chunk at a time, with no copy to
the host and no host read. Every rank must draw the same noise (the replicas must stay
identical, and ``replicas[calibration]`` checks them), but torch's own device generators do
not promise that across devices: on CUDA an element's draw depends on the launch grid,
which depends on the GPU's number of multiprocessors, so two GPU models given one seed draw
different noise. So the noise comes from a counter-based generator of plain integer
arithmetic instead: element ``i`` of parameter ``name`` at step ``s`` is a function of
``(seed, s, name, i)`` alone, computed by int64 tensor ops whose every intermediate value
stays below 2**63 (nothing overflows, nothing is left to the device), so every device --
the CPU included -- draws the same bits, whatever the chunking. Keys come from the seed,
the step and the parameter's name on the host (blake2b); each element then goes through
:data:`ROUNDS` rounds of a multiplication modulo the prime 2**31 - 1 by one of
Fishman and Moore's multipliers plus a key, each followed by a xor-shift, and its top 24
bits make a float32 in [0, 1) (the resolution of ``torch.rand``'s float32).
"""

from __future__ import annotations

import hashlib

import torch

from qwz.qualify.evidence import spec

PRIME = 2**31 - 1
"""The modulus: every product of two residues is below 2**62."""
MULTIPLIERS = (742_938_285, 950_706_376, 1_226_874_159)
"""Fishman and Moore's multipliers for the modulus 2**31 - 1, one per round."""
HIGH_MULTIPLIER = 62_089_911
"""Folds an index's part above the modulus into the first round."""
ROUNDS = len(MULTIPLIERS)
NOISE_CHUNK_NUMEL = 1 << 22
"""Elements drawn at a time (rounded down to whole groups): int64 temporaries of 32 MiB."""


def _keys(seed: int, step: int, name: str) -> tuple[int, ...]:
    """One key in [1, PRIME) per round, and one for the index, from (seed, step, name)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{name}".encode(), digest_size=8 * (ROUNDS + 1))
    words = [digest.digest()[8 * k : 8 * k + 8] for k in range(ROUNDS + 1)]
    return tuple(1 + int.from_bytes(word, "little") % (PRIME - 1) for word in words)


def uniform(keys: tuple[int, ...], start: int, numel: int, device: torch.device) -> torch.Tensor:
    """float32 (numel,) in [0, 1): the draws of elements ``start .. start + numel - 1``
    under `keys` ([Note: calibration noise on the device])."""
    index = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    x = index.remainder(PRIME).add_(index.div(PRIME, rounding_mode="floor").mul_(HIGH_MULTIPLIER))
    x.add_(keys[-1]).remainder_(PRIME)  # below 2**31 from here on
    for multiplier, key in zip(MULTIPLIERS, keys[:ROUNDS], strict=True):
        x.mul_(multiplier).add_(key).remainder_(PRIME)  # below 2**62 before the remainder
        x.bitwise_xor_(x >> 16)
    return (x >> 7).to(torch.float32).mul_(2.0**-24)


@torch.no_grad()
def perturb(module: torch.nn.Module, group_size: int, seed: int, step: int) -> None:
    """Add the calibration noise of `step` to the working copy of every parameter of
    `module` that the spec quantizes: uniform in [-scale/2, scale/2] per group of
    `group_size` elements of the parameter (the last group zero-padded), scale from
    :func:`spec.scales`, the same on every rank; the masters are untouched (the next
    gather overwrites the working copy)."""
    chunk_numel = max(1, NOISE_CHUNK_NUMEL // group_size) * group_size
    for name, param in module.named_parameters():
        if spec.travels_exactly(param.numel()):
            continue
        keys = _keys(seed, step, name)
        flat = param.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk_numel):
            values = flat[start : start + chunk_numel]
            scales = spec.scales(values, group_size)  # (groups,)
            draws = uniform(keys, start, scales.numel() * group_size, flat.device)
            noise = (draws.view(-1, group_size) - 0.5).mul_(scales[:, None]).view(-1)
            values.add_(noise[: values.numel()].to(values.dtype))
