"""Every rank's own shard against the contract, at the next use of the weights.

[Note: own shard against the spec]
At the next use of the weights after every step ([Note: observed at the next use],
next_use.py), every element of every rank's own shard is compared with what the contract
lets the gather write there ([Note: the contract and its freedoms],
qualify/evidence/spec.py), with the *requested* group size -- equality, not a bound, so a
candidate whose scales or codes the contract does not allow fails even where its error
would stay within half a scale. Per group, one choice of :func:`spec.decode_choices`
(quantization input, scale within an ulp) must give every element, each the nearest code
or, at a near-tie, its neighbour; the first such choice is the group's, so an element is
counted as ``reference`` when it is bit for bit the reference arithmetic and otherwise under
each freedom it used (``working_input``, ``scale_ulp``, ``near_ties``). In a group no choice
gives whole, the choice that gives the most elements is taken, the others are the
mismatches, and no freedom is counted (the group used none the contract allows).
The exact elements (those of parameters of at most 65,536 elements, everything when
nothing is quantized) must equal the master cast to the working dtype. The worst error over
``scale/2 + 2**-15 scale + two half-ulps`` (the input's and the output's casts) is kept as
context. The shards are checked in bounded pieces of whole groups on every device
(:func:`piece_numel`), with one host synchronisation per shard and one per piece: whether
the reference arithmetic gives the whole piece. Only where it does not are the other
choices computed, so a piece written by the reference arithmetic costs one decode, not six.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from qwz import shards as seam
from qwz.qualify.evidence import spec
from qwz.qualify.run.observers.piecewise import piece_numel


def exact_masks(
    shards: Sequence[seam.OwnShard],
    group_size: int | None,
    param_numel: dict[str, int],
    gather_ranks: Sequence[int],
) -> list[torch.Tensor]:
    """Per shard, (n,) bool: the exact elements, by the spec whatever the engine's
    ``OwnShard.exact_mask`` says -- those of parameters that travel exactly
    (:func:`spec.travels_exactly`), and every
    element when nothing is quantized (`group_size` None) or when the shard's gather group
    has one rank (`gather_ranks`: per shard, the ranks of that group;
    :func:`spec.gather_travels_exactly`)."""
    if len(gather_ranks) != len(shards):
        raise ValueError(
            f"gather_ranks: {len(gather_ranks)} entries for {len(shards)} own shards; one per shard"
        )
    masks = []
    for shard, ranks in zip(shards, gather_ranks, strict=True):
        mask = torch.zeros(shard.master.numel(), dtype=torch.bool, device=shard.master.device)
        exact_shard = group_size is None or spec.gather_travels_exactly(ranks)
        for slot in shard.slots:
            if exact_shard or spec.travels_exactly(param_numel[slot.name]):
                mask[slot.start : slot.end] = True
        masks.append(mask)
    return masks


@dataclass
class OwnShardResult:
    """Totals of [Note: own shard against the spec] on one rank for one arm. Where every
    group is within the contract, every checked element is counted once in ``reference``
    (bit for bit the reference arithmetic) or else under each freedom of [Note: the contract
    and its freedoms] it used (``working_input``, ``scale_ulp``, ``near_ties``; one element
    may use several); ``mismatches`` are the elements outside it."""

    checked: int = 0
    mismatches: int = 0
    near_ties: int = 0
    """Elements that took the other code at a near-tie (freedom 2)."""
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None
    reference: int = 0
    """Elements equal, bit for bit, to the reference arithmetic (the fp32 master, the spec's
    scale, the nearest code; the exact cast where the spec sends exactly)."""
    working_input: int = 0
    """Elements of groups decoded from the master cast to the working dtype (freedom 1)."""
    scale_ulp: int = 0
    """Elements of groups decoded with a scale one fp32 ulp from the spec's (freedom 2)."""


class _PieceVerdict(NamedTuple):
    mismatch: torch.Tensor
    """(n,) bool: no decode the contract allows for the element's group gives it (nor, exact,
    the cast)."""
    reference: torch.Tensor
    """(n,) bool: bit for bit the reference arithmetic, and not a mismatch."""
    near_tie: torch.Tensor
    """(n,) bool: not the reference, in a group the contract accepts, took the other code
    of a near-tie."""
    working_input: torch.Tensor
    """(n,) bool: not the reference, in a group the contract accepts as decoded from the
    working-dtype cast."""
    scale_ulp: torch.Tensor
    """(n,) bool: not the reference, in a group the contract accepts with a scale one ulp
    from the spec's."""
    ratio: torch.Tensor
    """(n,) fp32: context, |working - master| / (scale/2 + allowance + two half-ulps)."""
    expected: torch.Tensor
    """(n,) the reference decode (or the exact cast), in the working dtype."""
    element_scales: torch.Tensor
    """(n,) fp32: the spec's scale of each element's group (the reference's)."""


def _per_group(flags: torch.Tensor, group_size: int) -> torch.Tensor:
    """(choices, n) bool -> (choices, ceil(n / G)): whether every element of each group of
    `group_size` is set (a partial last group: its elements only)."""
    padding = -flags.shape[1] % group_size
    padded = torch.nn.functional.pad(flags, (0, padding), value=True)
    return padded.view(flags.shape[0], -1, group_size).all(dim=2)


def _judge_piece(
    master: torch.Tensor, working: torch.Tensor, group_size: int | None, exact: torch.Tensor
) -> _PieceVerdict:
    """[Note: own shard against the spec] for whole groups of one shard (fp32 `master`,
    `working` in the working dtype, bool `exact`, all (n,)): per group, the first choice of
    :func:`spec.decode_choices` that gives every element of it; where none does, the choice
    that gives the most, and its other elements are the mismatches. Where the first choice,
    the reference, gives every element of the piece, the other choices cannot change that
    verdict and are not computed (one host synchronisation says which)."""
    dtype = working.dtype
    cast = master.to(dtype)
    false = torch.zeros_like(exact)
    if group_size is None:
        element_scales = torch.zeros_like(master)
        mismatch = working != cast
        reference = ~mismatch
        ratio_bound = spec.half_ulp(torch.maximum(master.abs(), working.float().abs()), dtype)
        return _verdict(master, working, cast, element_scales, mismatch, reference,
                        false, false, false, exact, ratio_bound)  # fmt: skip
    choices = spec.decode_choices(master, exact, group_size, dtype)
    first = next(choices)
    nearest = torch.where(exact, cast, first.nearest.to(dtype))
    equal_nearest = working == nearest
    if bool((equal_nearest | (working == torch.where(exact, cast, first.other.to(dtype)))).all()):
        # Every group is the reference's: what is not its nearest code is a near-tie.
        ratio_bound = _ratio_bound(master, working, first.element_scales)
        return _verdict(master, working, nearest, first.element_scales, false, equal_nearest,
                        ~equal_nearest, false, false, exact, ratio_bound)  # fmt: skip
    return _judge_among_choices(master, working, exact, group_size, [first, *choices])


def _ratio_bound(master, working, element_scales):
    """The context ratio's denominator: half a scale, the tie allowance, and a half-ulp for
    each of the input's and the output's casts."""
    magnitude = torch.maximum(master.abs(), working.float().abs())
    return element_scales * (0.5 + spec.TIE_ALLOWANCE) + 2 * spec.half_ulp(magnitude, working.dtype)


def _judge_among_choices(master, working, exact, group_size, choices):
    """:func:`_judge_piece` weighing every choice (`choices`, the reference first): each
    group's first accepting choice, else the choice that gives the most."""
    dtype = working.dtype
    cast = master.to(dtype)
    nearest = torch.stack([torch.where(exact, cast, c.nearest.to(dtype)) for c in choices])
    other = torch.stack([torch.where(exact, cast, c.other.to(dtype)) for c in choices])
    equal_nearest = working == nearest  # (choices, n)
    matches = equal_nearest | (working == other)
    whole = _per_group(matches, group_size)  # (choices, groups)
    counts = torch.nn.functional.pad(matches, (0, -matches.shape[1] % group_size))
    counts = counts.view(len(choices), -1, group_size).sum(dim=2)
    # argmax returns the first maximum: the earliest accepting choice (the reference first),
    # else the choice that gives the most elements.
    accepted = whole.any(dim=0)
    chosen = torch.where(accepted, whole.int().argmax(dim=0), counts.argmax(dim=0))
    chosen = chosen.repeat_interleave(group_size)[: master.numel()]  # (n,)
    in_contract = accepted.repeat_interleave(group_size)[: master.numel()]  # (n,)
    pick = chosen.unsqueeze(0)
    mismatch = ~matches.gather(0, pick)[0]
    reference = equal_nearest[0] & ~mismatch
    # Freedoms are counted only where the contract accepts the whole group: the closest choice
    # of a group outside it says nothing about what the candidate meant to do.
    freedom = ~reference & ~mismatch & in_contract
    working_input = torch.tensor([c.working_input for c in choices], device=master.device)
    scale_ulp = torch.tensor([c.scale_ulp != 0 for c in choices], device=master.device)
    near_tie = freedom & ~equal_nearest.gather(0, pick)[0]
    element_scales = choices[0].element_scales
    return _verdict(master, working, nearest[0], element_scales, mismatch, reference, near_tie,
                    freedom & working_input[chosen], freedom & scale_ulp[chosen], exact,
                    _ratio_bound(master, working, element_scales))  # fmt: skip


def _verdict(
    master, working, expected, element_scales, mismatch, reference, near_tie, working_input,
    scale_ulp, exact, ratio_bound,
) -> _PieceVerdict:  # fmt: skip
    error = (working.float() - master).abs()
    ratio = torch.where(error == 0, torch.zeros_like(error), error / ratio_bound)
    infinite = torch.isnan(ratio) | (mismatch & exact)  # an exact element that is not exact
    ratio = torch.where(infinite, torch.full_like(ratio, math.inf), ratio)
    return _PieceVerdict(mismatch, reference, near_tie, working_input, scale_ulp, ratio,
                         expected, element_scales)  # fmt: skip


_COUNTED = ("mismatch", "reference", "near_tie", "working_input", "scale_ulp")
"""The _PieceVerdict flags summed into OwnShardResult (mismatch first)."""


_RESULT_FIELD = {"mismatch": "mismatches", "near_tie": "near_ties"}


@torch.no_grad()
def check_own_shards(
    shards: Sequence[seam.OwnShard],
    exact: Sequence[torch.Tensor],
    group_size: int | None,
    step: int,
    rank: int,
    result: OwnShardResult,
) -> None:
    """[Note: own shard against the spec] for every own shard, with the *requested* group size
    and the spec's exactness rule (`exact`, from :func:`exact_masks`), never the engine's
    claims; bounded pieces of whole groups, one host synchronisation per shard and one per
    piece."""
    for shard, mask in zip(shards, exact, strict=True):
        master = shard.master.detach().reshape(-1).float()
        working = shard.working.detach().reshape(-1)
        numel = master.numel()
        if working.numel() != numel or mask.numel() != numel:
            raise ValueError(
                f"{shard.name}: working ({working.numel()} elements) and exact mask "
                f"({mask.numel()}) must match the master ({numel})"
            )
        if numel == 0:
            continue
        piece = piece_numel(master.device, group_size or 1)
        pieces = [(start, min(start + piece, numel)) for start in range(0, numel, piece)]
        totals = torch.zeros(len(_COUNTED) + 1, dtype=torch.float64, device=master.device)
        for start, end in pieces:
            verdict = _judge_piece(
                master[start:end], working[start:end], group_size, mask[start:end]
            )
            for index, name in enumerate(_COUNTED):
                totals[index] += getattr(verdict, name).sum()
            totals[-1] = torch.maximum(totals[-1], verdict.ratio.max().double())
        *counted, worst = totals.tolist()
        result.checked += numel
        for name, value in zip(_COUNTED, counted, strict=True):
            field_name = _RESULT_FIELD.get(name, name)
            setattr(result, field_name, getattr(result, field_name) + int(value))
        mismatches = counted[0]
        result.max_ratio = max(result.max_ratio, worst)
        if mismatches and result.first_violation is None:
            result.first_violation = _first_mismatch(
                shard, master, working, mask, group_size, pieces, step, rank
            )


def _first_mismatch(shard, master, working, mask, group_size, pieces, step, rank) -> dict:
    """The first element of a shard that differs from the spec's decode (the rare path)."""
    for start, end in pieces:
        verdict = _judge_piece(master[start:end], working[start:end], group_size, mask[start:end])
        if bool(verdict.mismatch.any()):
            at = int(verdict.mismatch.nonzero()[0])
            name, index = seam.slot_of(shard, start + at)
            ratio = float(verdict.ratio[at])
            exact_required = bool(mask[start + at])
            what = (
                f"master {float(master[start + at]):.9g}: the spec decodes to "
                f"{float(verdict.expected[at]):.9g}"
                + ("" if exact_required else f" (scale {float(verdict.element_scales[at]):.6g})")
                + f", the working copy holds {float(working[start + at]):.9g}"
                + ("" if exact_required or group_size is None else
                   ", which no decode the contract allows for its group gives "
                   "([Note: the contract and its freedoms])")
            )  # fmt: skip
            return {
                "step": step,
                "rank": rank,
                "parameter": name,
                "index": index,
                "ratio": ratio if math.isfinite(ratio) else None,
                "exact_required": exact_required,
                "what": what,
            }
    raise AssertionError("a mismatch was counted but not found again")  # pragma: no cover
