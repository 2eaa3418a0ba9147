"""Every rank's own shard against the contract, at the next use of the weights.

[Note: own shard against the spec]
At the next use of the weights after every step ([Note: observed at the next use],
next_use.py), every element of every rank's own shard is compared with what the contract
lets the gather write there ([Note: the contract and its freedoms],
qualify/evidence/spec.py), with the *requested* group size -- equality, not a bound, so a
candidate whose scales or codes the contract does not allow fails even where its error
would stay within half a scale. Per group, one scheme of the contract and one choice of its
freedoms (:func:`contract.choices`: quantization input, scale arithmetic, decode rounding)
must give every element, each the nearest code or, at a near-tie, its neighbour; the first
such choice is the group's, so an element is counted as ``reference`` when it is bit for bit
its scheme's reference arithmetic and otherwise under each freedom it used. In a group no
choice gives whole, the choice that gives the most elements is taken, the others are the
mismatches, and no freedom is counted (the group used none the contract allows). The exact
elements (those of parameters of at most 65,536 elements, everything when nothing is
quantized) must equal the master cast to the working dtype.

Which scheme, per rank ([Note: one scheme per run], qualify/evidence/contract.py): until a
rank has identified its scheme, each piece is tried under every scheme's reference; the
first piece that exactly one of them gives whole identifies it (``OwnShardResult.scheme``),
and from then on that scheme's reference is tried first, alone. A piece no reference gives
whole is weighed under every choice of every scheme, the identified one's first; its groups
that only one scheme accepts are that scheme's evidence (``by_scheme``), so a rank that wrote
two schemes shows both. Groups of DeepSpeed's scheme whose input staged an fp16 infinity are
counted as ``fp16_overflow`` ([Note: DeepSpeed's ZeRO++ scheme], evidence/zeropp.py).

The shards are checked in bounded pieces of whole groups on every device (:func:`piece_numel`),
with one host synchronisation per shard and one per reference tried per piece. Where nothing
matches, the first mismatching piece is weighed once more to say which scheme came nearest
and which named near miss (:data:`contract.NEAR_MISSES`) explains its mismatches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from qwz import shards as seam
from qwz.qualify.evidence import contract, spec
from qwz.qualify.run.observers import scheme_cost
from qwz.qualify.run.observers.arm_observer import ArmObserver
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
    (bit for bit its scheme's reference arithmetic) or else under each freedom of [Note: the
    contract and its freedoms] it used (``working_input``, ``scale_ulp``, ``near_ties``,
    ``unrounded_decode``; one element may use several); ``mismatches`` are the elements
    outside it."""

    checked: int = 0
    mismatches: int = 0
    near_ties: int = 0
    """Elements that took the other code, or the other rounding of the decode, at a near-tie."""
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None
    reference: int = 0
    """Elements equal, bit for bit, to their scheme's reference arithmetic (the fp32 master,
    the scheme's scale, the nearest code and rounding; the exact cast where the spec sends
    exactly)."""
    working_input: int = 0
    """Elements of groups decoded from the master cast to the working dtype (freedom 1)."""
    scale_ulp: int = 0
    """Elements of groups decoded with a scale one fp32 ulp from absmax/127's (freedom 2)."""
    unrounded_decode: int = 0
    """DeepSpeed's scheme: elements of groups whose decode was cast once to the working
    dtype, not rounded through fp16."""
    scheme: str | None = None
    """The scheme this rank's shards identified ([Note: one scheme per run]); None: no piece
    told the schemes apart (or nothing is quantized)."""
    by_scheme: dict[str, int] = field(default_factory=dict)
    """Elements each scheme alone accounts for: the pieces its reference gave whole once it
    was identified (or while it alone did), and the groups only it accepts."""
    fp16_overflow: int = 0
    """DeepSpeed's scheme: elements of groups whose input staged an fp16 infinity (decoded
    to NaN): a failure of the scheme, counted apart from the mismatches."""
    cost: dict[str, Any] | None = None
    """[Note: what a scheme costs] (scheme_cost.py) on the last step's weights; None: not
    measured."""


class _PieceVerdict(NamedTuple):
    mismatch: torch.Tensor
    """(n,) bool: no decode the contract allows for the element's group gives it (nor, exact,
    the cast)."""
    reference: torch.Tensor
    """(n,) bool: bit for bit its scheme's reference arithmetic, and not a mismatch."""
    near_tie: torch.Tensor
    """(n,) bool: not the reference, in an accepted group, took an alternative at a near-tie."""
    working_input: torch.Tensor
    scale_ulp: torch.Tensor
    unrounded_decode: torch.Tensor
    overflow: torch.Tensor
    """(n,) bool: in a group DeepSpeed's scheme accepts as staging an fp16 infinity."""
    scheme_only: dict[str, torch.Tensor]
    """Per scheme, (n,) bool: the element is that scheme's evidence (module docstring)."""
    ratio: torch.Tensor
    """(n,) fp32: context, |working - master| / (scale/2 + allowance + two half-ulps)."""
    expected: torch.Tensor
    """(n,) the first scheme's reference decode (or the exact cast), in the working dtype."""
    element_scales: torch.Tensor
    """(n,) fp32: each element's group scale under that reference."""
    identifies: str | None
    """The scheme this piece identifies, if it tells them apart."""


_FLAGS = ("working_input", "scale_ulp", "unrounded_decode")
"""The per-group freedoms a choice records (beyond near-ties)."""


def _candidates(choice: contract.Choice, exact: torch.Tensor, cast: torch.Tensor, dtype):
    """The working-dtype values `choice` allows per element, (alternatives, n); the exact
    elements' is their cast."""
    return torch.stack([torch.where(exact, cast, value.to(dtype)) for value in choice.values])


def _matches(working: torch.Tensor, candidates: torch.Tensor, choice: contract.Choice):
    """(alternatives, n) bool: the working value is that alternative (a NaN written where
    DeepSpeed's scheme staged an fp16 infinity is its decode)."""
    equal = working == candidates
    if choice.overflow is not None:
        equal = equal | (choice.overflow & torch.isnan(working))
    return equal


def _ratio_bound(master, working, element_scales):
    """The context ratio's denominator: half a scale, the tie allowance, and a half-ulp for
    each of the input's and the output's casts."""
    magnitude = torch.maximum(master.abs(), working.float().abs())
    return element_scales * (0.5 + spec.TIE_ALLOWANCE) + 2 * spec.half_ulp(magnitude, working.dtype)


def _ratio(master, working, ratio_bound, infinite):
    error = (working.float() - master).abs()
    ratio = torch.where(error == 0, torch.zeros_like(error), error / ratio_bound)
    return torch.where(torch.isnan(ratio) | infinite, torch.full_like(ratio, math.inf), ratio)


def _unquantized_piece(master, working, exact) -> _PieceVerdict:
    """Nothing is quantized: every element must be its master cast."""
    cast = master.to(working.dtype)
    false = torch.zeros_like(exact)
    mismatch = working != cast
    bound = spec.half_ulp(torch.maximum(master.abs(), working.float().abs()), working.dtype)
    return _PieceVerdict(
        mismatch, ~mismatch, false, false, false, false, false, {},
        _ratio(master, working, bound, mismatch & exact), cast, torch.zeros_like(master), None,
    )  # fmt: skip


def _whole_piece(master, working, exact, choice: contract.Choice, identifies) -> _PieceVerdict:
    """The verdict on a piece `choice` (a scheme's reference) gives whole."""
    dtype = working.dtype
    candidates = _candidates(choice, exact, master.to(dtype), dtype)
    equal = _matches(working, candidates, choice)
    false = torch.zeros_like(exact)
    nearest = equal[0]
    overflow = false if choice.overflow is None else choice.overflow & ~exact
    bound = _ratio_bound(master, working, choice.element_scales)
    return _PieceVerdict(
        false, nearest, ~nearest, false, false, false, overflow,
        {choice.scheme: ~exact}, _ratio(master, working, bound, overflow), candidates[0],
        choice.element_scales, identifies,
    )  # fmt: skip


def _gives_whole(working, candidates, choice) -> bool:
    return bool(_matches(working, candidates, choice).any(dim=0).all())


def _judge_piece(
    master: torch.Tensor,
    working: torch.Tensor,
    group_size: int | None,
    exact: torch.Tensor,
    identified: str | None,
) -> _PieceVerdict:
    """[Note: own shard against the spec] for whole groups of one shard (fp32 `master`,
    `working` in the working dtype, bool `exact`, all (n,)), the rank's `identified` scheme
    (None: not yet) tried first."""
    if group_size is None:
        return _unquantized_piece(master, working, exact)
    dtype = working.dtype
    cast = master.to(dtype)
    order = _order(identified)
    tried = order[:1] if identified else order
    streams = {
        scheme: contract.choices(scheme, master, exact, group_size, dtype) for scheme in order
    }
    references = {scheme: next(streams[scheme]) for scheme in tried}
    whole = [
        scheme
        for scheme in tried
        if _gives_whole(working, _candidates(references[scheme], exact, cast, dtype),
                        references[scheme])
    ]  # fmt: skip
    if identified and whole:
        return _whole_piece(master, working, exact, references[identified], None)
    if len(whole) == 1:  # one scheme's reference and not the other's: it identifies
        return _whole_piece(master, working, exact, references[whole[0]], whole[0])
    if len(whole) > 1:  # every reference gives it: evidence of neither
        verdict = _whole_piece(master, working, exact, references[order[0]], None)
        return verdict._replace(scheme_only={})
    if identified:  # its choices alone, unless some group is outside them all
        own = [references[identified], *streams[identified]]
        verdict = _judge_among_choices(master, working, exact, group_size, own)
        if not bool(verdict.mismatch.any()):
            return verdict
        every = own + [choice for scheme in order[1:] for choice in streams[scheme]]
    else:
        every = [choice for s in order for choice in (references[s], *streams[s])]
    return _judge_among_choices(master, working, exact, group_size, every)


def _order(identified: str | None) -> tuple[str, ...]:
    if identified is None:
        return contract.SCHEMES
    return (identified, *(scheme for scheme in contract.SCHEMES if scheme != identified))


def _per_group(flags: torch.Tensor, group_size: int) -> torch.Tensor:
    """(choices, n) bool -> (choices, ceil(n / G)): whether every element of each group of
    `group_size` is set (a partial last group: its elements only)."""
    padding = -flags.shape[1] % group_size
    padded = torch.nn.functional.pad(flags, (0, padding), value=True)
    return padded.view(flags.shape[0], -1, group_size).all(dim=2)


def _judge_among_choices(master, working, exact, group_size, choices) -> _PieceVerdict:
    """:func:`_judge_piece` weighing every choice of every scheme (`choices`, the rank's
    scheme first): each group's first accepting choice, else the choice that gives the most;
    a group only one scheme accepts is that scheme's evidence."""
    dtype, numel = working.dtype, master.numel()
    cast = master.to(dtype)
    candidates = [_candidates(choice, exact, cast, dtype) for choice in choices]
    equal = [
        _matches(working, values, choice)
        for values, choice in zip(candidates, choices, strict=True)
    ]
    equal_nearest = torch.stack([flags[0] for flags in equal])  # (choices, n)
    matches = torch.stack([flags.any(dim=0) for flags in equal])
    whole = _per_group(matches, group_size)  # (choices, groups)
    counts = torch.nn.functional.pad(matches, (0, -numel % group_size))
    counts = counts.view(len(choices), -1, group_size).sum(dim=2)
    # argmax returns the first maximum: the earliest accepting choice (the rank's scheme's
    # reference first), else the choice that gives the most elements.
    accepted = whole.any(dim=0)
    chosen_group = torch.where(accepted, whole.int().argmax(dim=0), counts.argmax(dim=0))
    chosen = chosen_group.repeat_interleave(group_size)[:numel]  # (n,)
    in_contract = accepted.repeat_interleave(group_size)[:numel]
    pick = chosen.unsqueeze(0)
    mismatch = ~matches.gather(0, pick)[0]
    first_of_scheme = {}
    for index, choice in enumerate(choices):
        first_of_scheme.setdefault(choice.scheme, index)
    is_reference = torch.tensor(
        [first_of_scheme[choice.scheme] == index for index, choice in enumerate(choices)],
        device=master.device,
    )
    reference = is_reference[chosen] & equal_nearest.gather(0, pick)[0] & ~mismatch
    freedom = ~reference & ~mismatch & in_contract
    flags = {
        name: torch.tensor([bool(getattr(c, name)) for c in choices], device=master.device)
        for name in _FLAGS
    }
    scheme_only = _scheme_evidence(choices, whole, exact, group_size, numel)
    overflow = torch.zeros_like(exact)
    for index, choice in enumerate(choices):
        if choice.overflow is not None:
            overflow |= (chosen == index) & choice.overflow & ~mismatch & ~exact
    first = choices[0]
    bound = _ratio_bound(master, working, first.element_scales)
    return _PieceVerdict(
        mismatch, reference, freedom & ~equal_nearest.gather(0, pick)[0],
        *(freedom & flags[name][chosen] for name in _FLAGS), overflow, scheme_only,
        _ratio(master, working, bound, (mismatch & exact) | overflow), candidates[0][0],
        first.element_scales, _identified_by(scheme_only),
    )  # fmt: skip


def _scheme_evidence(choices, whole, exact, group_size, numel) -> dict[str, torch.Tensor]:
    """Per scheme, (n,) bool: the non-exact elements of groups that scheme alone accepts."""
    schemes = list(dict.fromkeys(choice.scheme for choice in choices))
    accepted_by = {
        scheme: whole[[i for i, c in enumerate(choices) if c.scheme == scheme]].any(dim=0)
        for scheme in schemes
    }
    evidence = {}
    for scheme in schemes:
        alone = accepted_by[scheme].clone()
        for other in schemes:
            if other != scheme:
                alone &= ~accepted_by[other]
        evidence[scheme] = alone.repeat_interleave(group_size)[:numel] & ~exact
    return evidence


def _identified_by(scheme_only: dict[str, torch.Tensor]) -> str | None:
    """The scheme a weighed piece identifies: the one with the most evidence, if any."""
    counts = {scheme: int(flags.sum()) for scheme, flags in scheme_only.items()}
    best = max(counts, key=counts.get, default=None)
    return best if best is not None and counts[best] > 0 else None


_COUNTED = ("mismatch", "reference", "near_tie", *_FLAGS, "overflow")
"""The _PieceVerdict flags summed into OwnShardResult (mismatch first)."""

_RESULT_FIELD = {"mismatch": "mismatches", "near_tie": "near_ties", "overflow": "fp16_overflow"}


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
    claims; bounded pieces of whole groups."""
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
        by_scheme = {}
        for start, end in pieces:
            verdict = _judge_piece(
                master[start:end], working[start:end], group_size, mask[start:end], result.scheme
            )
            if result.scheme is None and verdict.identifies is not None:
                result.scheme = verdict.identifies
            for index, name in enumerate(_COUNTED):
                totals[index] += getattr(verdict, name).sum()
            totals[-1] = torch.maximum(totals[-1], verdict.ratio.max().double())
            for scheme, flags in verdict.scheme_only.items():
                by_scheme[scheme] = by_scheme.get(scheme, 0) + flags.sum()
        *counted, worst = totals.tolist()
        result.checked += numel
        for name, value in zip(_COUNTED, counted, strict=True):
            field_name = _RESULT_FIELD.get(name, name)
            setattr(result, field_name, getattr(result, field_name) + int(value))
        for scheme, count in by_scheme.items():
            result.by_scheme[scheme] = result.by_scheme.get(scheme, 0) + int(count)
        result.max_ratio = max(result.max_ratio, worst)
        if counted[0] and result.first_violation is None:
            result.first_violation = _first_mismatch(
                shard, master, working, mask, group_size, pieces, step, rank, result.scheme
            )


def _first_mismatch(shard, master, working, mask, group_size, pieces, step, rank, scheme) -> dict:
    """The first element of a shard outside the contract (the rare path), with the scheme
    that came nearest and the near miss that explains the piece's mismatches."""
    for start, end in pieces:
        piece = slice(start, end)
        verdict = _judge_piece(master[piece], working[piece], group_size, mask[piece], scheme)
        if not bool(verdict.mismatch.any()):
            continue
        at = int(verdict.mismatch.nonzero()[0])
        name, index = seam.slot_of(shard, start + at)
        ratio = float(verdict.ratio[at])
        exact_required = bool(mask[start + at])
        what = (
            f"master {float(master[start + at]):.9g}: the spec decodes to "
            f"{float(verdict.expected[at]):.9g}"
            + ("" if exact_required else f" (scale {float(verdict.element_scales[at]):.6g})")
            + f", the working copy holds {float(working[start + at]):.9g}"
        )
        if not exact_required and group_size is not None:
            what += ", which no decode the contract allows for its group gives; " + _diagnosis(
                master, working, mask, group_size, start + at, scheme
            )
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


DIAGNOSIS_NUMEL = 1 << 16
"""[Note: naming a near miss] weighs this many elements (whole groups) from the first
mismatching element's group on: the same window whatever the pieces."""


def _diagnosis(master, working, mask, group_size, at, scheme) -> str:
    from qwz.qualify.run.observers import near_miss

    start = at // group_size * group_size
    window = slice(
        start, min(master.numel(), start + max(1, DIAGNOSIS_NUMEL // group_size) * group_size)
    )
    verdict = _judge_piece(master[window], working[window], group_size, mask[window], scheme)
    return near_miss.diagnose(
        master[window], working[window], mask[window], group_size, verdict.mismatch
    )


class OwnShards(ArmObserver):
    """The own-shard observer: every own shard against the contract at each next use of the
    weights, with the requested group size, and on the last step what the scheme cost
    ([Note: what a scheme costs], scheme_cost.py): the ``own_shard`` field."""

    def __init__(
        self,
        shards: Sequence[seam.OwnShard],
        masks: list[torch.Tensor],
        group_size: int | None,
        *,
        rank: int,
        last_step: int,
    ) -> None:
        self.shards, self.masks, self.group_size = shards, masks, group_size
        self.rank, self.last_step = rank, last_step
        self.result = OwnShardResult()

    def at_next_use(self, step: int, first_update_step: int | None) -> None:
        if first_update_step is None:
            # fp16: every step so far overflowed and was skipped, so no gather has run: the
            # working copy must still be the model as built, its master cast exactly.
            untouched = [torch.ones_like(mask) for mask in self.masks]
            check_own_shards(self.shards, untouched, None, step, self.rank, self.result)
            return
        check_own_shards(self.shards, self.masks, self.group_size, step, self.rank, self.result)
        if self.group_size is not None and step == self.last_step:
            self.result.cost = scheme_cost.measure(self.shards, self.masks, self.group_size)

    def report(self) -> dict[str, Any]:
        return {"own_shard": dataclasses.asdict(self.result)}
