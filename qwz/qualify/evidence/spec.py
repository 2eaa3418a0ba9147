"""The spec every implementation is judged by, stated by the harness itself.

DESIGN.md ("The spec") is written out here a second time, independently of
qwz's own code: the judge must never take its rules from the code it judges,
or a commit that changes the rules everywhere at once (``absmax/100`` in
``qwz.quant``, say) would pass as faithfully as the correct code does.

[Note: the judge's independence]
This module imports nothing from ``qwz`` (only ``typing`` and ``torch``): no
``qwz.quant``, ``qwz.layout``, ``qwz.shards`` or anything that imports them (the evidence's
tolerance imports this module, never the reverse). ``tests/unit/qualify/evidence/test_spec.py``
inspects its imports and fails if one appears. The harness's other rules that depend on
the spec (the own-shard judgement in observers/own_shard.py, the calibration noise in runner.py,
the threshold of the exact elements) take their constants and formulas from here.

[Note: the spec's decode]
Per group of ``G`` consecutive elements of a flat shard (the grid starts at the
shard's first element; the last group may be partial; elements that travel
exactly count as zeros), in fp32 whatever the working dtype::

    scale = absmax / 127            fp32, correctly rounded; 0 for an all-zero group,
                                    at least 2**-126 otherwise
    code  = round-to-nearest(x / scale)     clamped to [-127, 127]; 0 where scale is 0
    x_hat = code * scale            fp32, then cast to the working dtype

One edge of fp32: where ``127 * scale`` would round to infinity (absmax within
an ulp of the fp32 maximum), the scale is the next float32 below, so that a
finite group never decodes to infinity. A NaN or infinite element makes its
group's scale non-finite.

What the judge allows beyond the letter of the spec, and why: qwz's kernels
(and any fast kernel) multiply by the fp32 reciprocal of the scale instead of
dividing, which moves ``x / scale`` by at most ``127 * 2**-23`` of a code; DESIGN
grants them ``2**-15 * scale``. So where ``x / scale`` lies within
:data:`TIE_ALLOWANCE` of a half-integer ``k + 1/2``, either neighbouring code
(``k`` or ``k + 1``) is accepted; everywhere else the code must be the spec's
nearest one. Round-to-nearest does not say how to break an exact tie, and
exact ties lie inside the allowance, so half-to-even and half-away-from-zero
both conform. The scale's own freedom, one fp32 ulp, is in [Note: the contract and its
freedoms].

:func:`decode_alternatives` computes both candidates in float32 with one
correctly rounded division: ``fl(x / scale)`` differs from the exact quotient
by at most ``127 * 2**-24`` (below the allowance's margin over the kernels'
``127 * 2**-23``), so every code a reciprocal kernel may produce is accepted.

[Note: the contract and its freedoms]
The decode above is the *reference arithmetic* of the scheme ``absmax/127``; the PR (#8511)
fixes less than it, and calls another scheme. What a correct implementation must do, per
group of ``G`` consecutive elements of a rank's partition (the grid anchored at the
partition's first element; the *exact elements*, those that travel exactly, count as zeros
in their group):

- symmetric int8 codes and one fp32 scale per group under one named *scheme*, the same on
  every rank and arm ([Note: one scheme per run], contract.py): ``absmax/127`` (this
  module: scale ``absmax/127``, codes rounded to nearest in ``[-127, 127]``, ``x_hat = code *
  scale`` written in the working dtype), or DeepSpeed's ZeRO++ quantizer, which the upstream
  PR calls ([Note: DeepSpeed's ZeRO++ scheme], zeropp.py: fp16 staging, ``q = 256/(2m)``,
  codes clamped to ``[-128, 127]``, stored scale ``1/q``, decode through fp16), each with the
  freedoms written beside it (below for absmax/127, in zeropp.py for ZeRO++);
- every element of a parameter of at most :data:`EXACT_MAX_NUMEL` elements an exact
  element (:func:`travels_exactly`: the master cast to the working dtype), and every element
  exact over a one-rank gather (:func:`gather_travels_exactly`);
- every rank, the owner too, writing the same decoded values (the ``replicas`` check);
- chunks of whole groups (a group split across chunks has two scales, which no choice
  below allows).

What it leaves free, and a correct PR may use:

1. *The quantization input*: the fp32 master, or the master cast to the working dtype
   (DeepSpeed copies the master into the bf16 partition before its gather, so a PR that
   quantizes inside the gather quantizes bf16). The scale is then ``absmax/127`` of that
   input (:data:`QUANTIZATION_INPUTS`).
2. *The scale's arithmetic*, up to one fp32 ulp: ``absmax * (1/127)``, a reciprocal kernel,
   a fast-math division each give ``absmax/127`` correctly rounded or one of its fp32
   neighbours (:data:`SCALE_ULPS`, :func:`scale_neighbours`); and at a rounding tie either
   neighbouring code (:data:`TIE_ALLOWANCE`, above).
3. *The collective primitive*, how codes, scales and exact elements are packed and chunked,
   and the order in which sources are decoded: none of it shows in the values written (the
   wire accounting judges the bytes, not their layout).
4. *When the decode completes*, as long as it is complete before the weights are next used:
   the harness observes own shards and replicas at the next forward, not when ``step()``
   returns ([Note: observed at the next use], qualify/run/next_use.py).

A group is within the contract when one choice of input (1) and one scale (2) -- the same
for every element of the group -- gives every element of it, each code the nearest or, at a
near-tie, its neighbour (:func:`decode_choices`). Anything else is outside: another divisor
(``absmax/100``, ``absmax/128`` clamped), floor rounding, a scale two ulps off, groups
anchored elsewhere, a code off by one away from a tie, another exactness threshold, a small
parameter quantized, the owner keeping its exact values. The judge counts how many elements
were bit for bit the reference arithmetic and which freedom each of the others used.

A gather over a process group of one rank has nothing to send (it is a local copy), so
nothing is quantized there: every element of such a shard travels exactly, whatever group
size was requested (:func:`gather_travels_exactly`; qwz's engine reports no group size).

Wire bytes: a quantized element costs ``1 + 4 / G`` bytes (its int8 code and
its share of the group's fp32 scale), against the working dtype's size when
it travels exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

CODE_MAX = 127
"""Largest code magnitude: codes lie in [-127, 127], and absmax maps to 127 (not 128)."""

MIN_SCALE = 2.0**-126
"""Smallest nonzero scale: the smallest normal float32."""

EXACT_MAX_NUMEL = 65_536
"""Parameters of at most this many elements travel exactly: their elements are exact
elements, the master cast to the working dtype (qwz's engine and drop-in call them the same,
and take the threshold from ``zero_quantized_weights_preserve_numel``; the judge keeps its
own copy)."""

SCALE_BYTES = 4
"""Bytes of one group's fp32 scale on the wire."""

CODE_BYTES = 1
"""Bytes of one element's int8 code on the wire."""

TIE_ALLOWANCE = 2.0**-15
"""Distance of ``x / scale`` from a half-integer, in codes, within which either
neighbouring code is accepted (DESIGN's ``2**-15 * scale``); see the module docstring."""


QUANTIZATION_INPUTS = ("master", "working")
"""[Note: the contract and its freedoms], freedom 1: the values a correct PR may quantize --
the fp32 master, or the master cast to the working dtype."""

SCALE_ULPS = 1
"""[Note: the contract and its freedoms], freedom 2: how many fp32 ulps a group's scale may
lie from ``absmax/127`` correctly rounded."""


def wire_bytes_per_element(group_size: int) -> float:
    """Bytes on the wire per quantized element at `group_size`: ``1 + 4 / G``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: {group_size!r} is invalid: must be a positive integer")
    return CODE_BYTES + SCALE_BYTES / group_size


def travels_exactly(param_numel: int) -> bool:
    """Whether a parameter of `param_numel` elements travels exactly (its elements are exact
    elements)."""
    return param_numel <= EXACT_MAX_NUMEL


def gather_travels_exactly(gather_ranks: int) -> bool:
    """Whether a weight gather over a process group of `gather_ranks` ranks travels exactly:
    one rank sends nothing, so nothing is quantized (module docstring)."""
    if isinstance(gather_ranks, bool) or not isinstance(gather_ranks, int) or gather_ranks < 1:
        raise ValueError(f"gather_ranks: {gather_ranks!r} is invalid: must be an integer >= 1")
    return gather_ranks == 1


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound on half the spacing of `dtype` at |values| (fp32): the most one
    round-to-nearest cast to `dtype` moves a value."""
    info = torch.finfo(dtype)
    return torch.clamp(values.abs(), min=info.tiny) * (info.eps / 2)


def scales(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The spec's fp32 scale of each group of `group_size` consecutive elements of flat
    `values` (the last group zero-padded): float32 (ceil(n / G),)."""
    flat = values.detach().reshape(-1).to(torch.float32)
    num_groups = -(-flat.numel() // group_size)
    padded = torch.zeros(num_groups * group_size, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    absmax = padded.view(num_groups, group_size).abs().amax(dim=1)  # (num_groups,)
    scale = absmax / CODE_MAX
    scale = torch.where(absmax == 0, absmax, torch.clamp(scale, min=MIN_SCALE))
    finite_group = torch.isfinite(absmax)
    too_large = finite_group & torch.isinf(scale * CODE_MAX)
    return torch.where(too_large, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def decode_alternatives(
    values: torch.Tensor, element_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_hat, x_hat_other)``: fp32 (n,) decodes of fp32 `values` (n,) with each element's
    group scale `element_scales` (n,): the spec's nearest code, and the code on the other side
    of a half-integer where ``x / scale`` lies within :data:`TIE_ALLOWANCE` of one (equal to
    ``x_hat`` elsewhere). Non-finite groups decode to NaN in both."""
    zero = element_scales == 0
    quotient = values / torch.where(zero, torch.ones_like(element_scales), element_scales)
    nearest = torch.round(quotient)  # half to even; any tie rule is accepted (see above)
    below = torch.floor(quotient)
    near_tie = (quotient - below - 0.5).abs() <= TIE_ALLOWANCE
    other = torch.where(near_tie, 2 * below + 1 - nearest, nearest)
    nearest = torch.where(zero, torch.zeros_like(nearest), nearest).clamp(-CODE_MAX, CODE_MAX)
    other = torch.where(zero, torch.zeros_like(other), other).clamp(-CODE_MAX, CODE_MAX)
    return nearest * element_scales, other * element_scales


def decode(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The spec's x_hat of flat `values` (fp32 (n,)) in groups of `group_size`: fp32 (n,),
    the nearest code everywhere (no allowance)."""
    flat = values.detach().reshape(-1).to(torch.float32)
    element_scales = scales(flat, group_size).repeat_interleave(group_size)[: flat.numel()]
    return decode_alternatives(flat, element_scales)[0]


def scale_neighbours(group_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(up, down)``: the fp32 neighbours, :data:`SCALE_ULPS` away, of the spec's
    `group_scales` (:func:`scales`) that [Note: the contract and its freedoms] allows. An
    all-zero group keeps scale 0, no scale goes below :data:`MIN_SCALE`, and none so large
    that ``127 * scale`` is infinite (there the spec's own scale stands in)."""
    infinity = torch.full_like(group_scales, torch.inf)
    up = torch.nextafter(group_scales, infinity)
    down = torch.nextafter(group_scales, -infinity)
    zero = group_scales == 0
    overflows = torch.isfinite(group_scales) & torch.isinf(up * CODE_MAX)
    up = torch.where(zero | overflows, group_scales, up)
    down = torch.where(zero, group_scales, torch.clamp(down, min=MIN_SCALE))
    return up, down


class DecodeChoice(NamedTuple):
    """One way of writing a group that [Note: the contract and its freedoms] allows."""

    working_input: bool
    """Quantized the master cast to the working dtype (freedom 1), not the fp32 master."""
    scale_ulp: int
    """The scale's distance from ``absmax/127`` in fp32 ulps: 0, +1 or -1 (freedom 2)."""
    nearest: torch.Tensor
    """fp32 (n,): every element's decode with the nearest code."""
    other: torch.Tensor
    """fp32 (n,): the decode with the other code where ``x / scale`` is at a near-tie
    (``nearest`` elsewhere)."""
    element_scales: torch.Tensor
    """fp32 (n,): each element's group scale under this choice."""


def decode_choices(
    master: torch.Tensor, exact: torch.Tensor, group_size: int, dtype: torch.dtype
) -> Iterator[DecodeChoice]:
    """Every decode [Note: the contract and its freedoms] allows for flat fp32 `master` (n,)
    whose `exact` (n,) elements travel exactly (zeros in their groups), in groups of
    `group_size` anchored at ``master[0]``, for working dtype `dtype`: the reference
    arithmetic first (the fp32 master, the spec's scale), then the same input with the
    scale one ulp up and one down, then those three quantizing the master cast to `dtype`
    (absent for fp32, where the cast is the master). Decodes are fp32, before the cast to
    `dtype`; what an ``exact`` element must hold is the caller's (the master's cast). Each
    choice is computed when it is asked for, so a caller that stops at the reference pays
    for the reference only."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: {group_size!r} is invalid: must be a positive integer")
    if master.shape != exact.shape or master.dim() != 1:
        raise ValueError(
            f"master {tuple(master.shape)} and exact {tuple(exact.shape)} must be one flat shape"
        )
    numel = master.numel()
    inputs = [(False, master.float())]
    if dtype != torch.float32:
        inputs.append((True, master.float().to(dtype).float()))
    for working_input, values in inputs:
        values = torch.where(exact, torch.zeros_like(values), values)
        spec_scales = scales(values, group_size)
        up, down = scale_neighbours(spec_scales)
        for scale_ulp, group_scales in ((0, spec_scales), (1, up), (-1, down)):
            element_scales = group_scales.repeat_interleave(group_size)[:numel]
            nearest, other = decode_alternatives(values, element_scales)
            yield DecodeChoice(working_input, scale_ulp, nearest, other, element_scales)
