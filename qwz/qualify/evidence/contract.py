"""The contract's quantization schemes, by name, and the near misses the judge can name.

[Note: one scheme per run]
The contract ([Note: the contract and its freedoms], spec.py) names two schemes: ``absmax/127``
(spec.py: the best symmetric int8 code at this wire cost, qwz's own) and DeepSpeed's ZeRO++
quantizer, ``zeropp`` ([Note: DeepSpeed's ZeRO++ scheme], zeropp.py: what the upstream PR
calls). A group is within the contract when one scheme and one choice of that scheme's
freedoms give every element of it. A run uses one scheme on every rank and every arm: a PR
calls one quantizer, so two schemes in one run mean two code paths that quantize differently
(the owner's and its peers', one arm's and another's), which no correct PR has; such a run
FAILs ``own-shard`` naming both, even though each group on its own is within the contract.
Groups that both schemes write alike (all-zero, exact, or a lone negative absmax) identify
neither and count for neither.

The order of :data:`SCHEMES` is the order in which an unidentified rank tries them; once a
rank's own shard has identified its scheme, that one is tried first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from qwz.qualify.evidence import spec, zeropp

ABSMAX_127 = "absmax/127"
ZEROPP = zeropp.NAME

SCHEMES = (ABSMAX_127, ZEROPP)
"""Every scheme of the contract, in the order an unidentified rank tries them."""

SCHEME_TEXT = {
    ABSMAX_127: "absmax/127 (scale absmax/127 in fp32, codes rounded to nearest in [-127, 127])",
    ZEROPP: zeropp.TEXT,
}
"""What each scheme is, in a sentence for a check's detail."""

SCHEME_SHORT = {ABSMAX_127: "absmax/127", ZEROPP: "DeepSpeed's ZeRO++ quantizer"}


class Choice(NamedTuple):
    """One way of writing a group that the contract allows, under one scheme."""

    scheme: str
    working_input: bool
    """Quantized the master cast to the working dtype (freedom 1), not the fp32 master."""
    scale_ulp: int
    """absmax/127: the scale's distance from ``absmax/127`` in fp32 ulps (0, +1, -1)."""
    unrounded_decode: bool
    """zeropp: the decode cast once to the working dtype, not rounded through fp16."""
    values: tuple[torch.Tensor, ...]
    """fp32 (n,) each: ``values[0]`` every element's decode with the nearest code and
    rounding (the choice's own arithmetic); the others, alternatives at near-ties."""
    element_scales: torch.Tensor
    """fp32 (n,): each element's group scale as it travels (absmax/127: the scale; zeropp:
    the stored ``1/q``)."""
    overflow: torch.Tensor | None
    """zeropp: (n,) bool, the element's group staged an fp16 infinity; None otherwise."""


def _absmax_choices(master, exact, group_size, dtype) -> Iterator[Choice]:
    for choice in spec.decode_choices(master, exact, group_size, dtype):
        yield Choice(
            ABSMAX_127, choice.working_input, choice.scale_ulp, False,
            (choice.nearest, choice.other), choice.element_scales, None,
        )  # fmt: skip


def _zeropp_choices(master, exact, group_size, dtype) -> Iterator[Choice]:
    for decode in zeropp.decodes(master, exact, group_size, dtype):
        yield Choice(
            ZEROPP, decode.working_input, 0, decode.unrounded_decode, decode.values,
            decode.stored_scale, decode.overflow,
        )  # fmt: skip


CHOICES: dict[str, Callable[..., Iterator[Choice]]] = {
    ABSMAX_127: _absmax_choices,
    ZEROPP: _zeropp_choices,
}


def choices(
    scheme: str, master: torch.Tensor, exact: torch.Tensor, group_size: int, dtype: torch.dtype
) -> Iterator[Choice]:
    """Every choice `scheme` allows for flat fp32 `master` (n,) whose `exact` elements travel
    exactly, in groups of `group_size` anchored at ``master[0]``, for working dtype `dtype`:
    the scheme's reference arithmetic first; lazily."""
    if scheme not in CHOICES:
        raise ValueError(f"scheme: {scheme!r} is unknown; the contract's are {list(SCHEMES)}")
    return CHOICES[scheme](master, exact, group_size, dtype)


# ------------------------------------------------------------------ near misses


class NearMiss(NamedTuple):
    """A way of writing a group that the contract forbids but a broken PR has used."""

    what: str
    decode: Callable[[torch.Tensor, int], torch.Tensor]
    """(fp32 input (n,) with exact elements zeroed, group size) -> fp32 decode (n,)."""


def _grouped(values: torch.Tensor, group_size: int) -> torch.Tensor:
    padding = -values.numel() % group_size
    return torch.nn.functional.pad(values, (0, padding)).view(-1, group_size)


def _symmetric(values, group_size, divisor, low, high, rounding=torch.round):
    groups = _grouped(values, group_size)
    scale = groups.abs().amax(dim=1, keepdim=True) / divisor
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = rounding(groups / safe).clamp(low, high)
    return (codes * scale).reshape(-1)[: values.numel()]


def _zeropp_like(values, group_size, *, wrap=False, invert=True):
    groups = _grouped(values.to(torch.float16).float(), group_size)
    absmax = groups.abs().amax(dim=1, keepdim=True)
    q = torch.where(absmax == 0, torch.ones_like(absmax), torch.full_like(absmax, 128.0) / absmax)
    codes = torch.round(groups * q)
    codes = torch.where(codes > 127, codes - 256, codes) if wrap else codes.clamp(-128, 127)
    scale = torch.ones_like(q) / q if invert else q
    return (codes * scale).to(torch.float16).float().reshape(-1)[: values.numel()]


NEAR_MISSES = (
    NearMiss("a decode with scale absmax/128, codes clamped to [-127, 127]",
             lambda v, g: _symmetric(v, g, 128.0, -127, 127)),
    NearMiss("codes rounded down (floor) instead of to nearest, scale absmax/127",
             lambda v, g: _symmetric(v, g, 127.0, -127, 127, torch.floor)),
    NearMiss("DeepSpeed's ZeRO++ arithmetic without its clamp: code 128 wrapped to -128",
             lambda v, g: _zeropp_like(v, g, wrap=True)),
    NearMiss("DeepSpeed's ZeRO++ codes decoded with q instead of the stored scale 1/q",
             lambda v, g: _zeropp_like(v, g, invert=False)),
    NearMiss("a decode with scale absmax/100, codes clamped to [-127, 127]",
             lambda v, g: _symmetric(v, g, 100.0, -127, 127)),
    NearMiss("the value cast exactly to the working dtype (not quantized)",
             lambda v, g: v),
)  # fmt: skip
"""What the judge names when a piece is outside the contract: the first that explains the
most of its mismatching elements (each tried on the fp32 master and on its working cast)."""
