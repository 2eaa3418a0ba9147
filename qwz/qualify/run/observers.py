"""What the harness watches on every rank and every step, through the public seam only.

Everything here reads an engine through [Note: own shards] (qwz/shards.py) --
``own_shards()`` and ``shard_optimizer`` -- and the model's parameters, never
an engine's internals, so the same observers serve qwz's engine and the
DeepSpeed drop-in (stock DeepSpeed included, for the reference arm).

[Note: exact update check]
Given the gradient the optimizer is handed (this arm's own reduced and clipped
gradient) and its state before the step, an AdamW step is a fixed formula of
the run's hyperparameters (the plan's lr, betas, eps, weight decay -- not what
the optimizer object says, so a candidate that changed its own learning rate
is caught). ``UpdateCheck`` hooks the torch optimizer that steps the master
shards, captures a fixed, seeded sample of master elements, gradients and
moments before each step and the same elements after it, and recomputes the
step in float64::

    p1 = p0 * (1 - lr * wd)
    m1 = b1 * m0 + (1 - b1) * g          v1 = b2 * v0 + (1 - b2) * g**2
    p2 = p1 - lr / (1 - b1**t) * m1 / (sqrt(v1) / sqrt(1 - b2**t) + eps)

torch computes the same in float32. Each operation rounds once (relative
error <= 2**-24), so with ``u`` the update term and ``e`` = float32 epsilon::

    |p2_torch - p2| <= e * (|p1| + |p2|) + 16e * |u|
                       + 16e * lr / bc1 * (b1|m0| + (1-b1)|g|) / d + 2**-126

(the first term: the decay factor, the decayed weight and the final
subtraction, each rounded once; then the update's own roundings, and the
moments' roundings propagated through the division by ``d``, the float64
denominator). The moments get ``8e * (|old| + |new|)``.
Any error in the formula -- a learning rate off by any factor, a dropped weight
decay, a flipped or stale moment -- is far outside this, and the bound never
loosens with the step. Two more exact facts are checked on the same sample:
*continuity* (the master before step ``t`` equals, bit for bit, the master
after step ``t - 1``: nothing but the optimizer writes a master) and *one step
per step* (the optimizer stepped exactly once on every rank for every training
step; a silent skip is a failure).

[Note: global norm check]
The update check takes the gradient the optimizer is handed as given, so an
engine that computes the global norm wrongly -- and clips with it -- would pass
it on every arm alike. The judge recomputes what was applied instead: in the
shard optimizer's pre-step hook each rank sums the squares of every gradient it
is handed (float64: a float32 square is exact there), the sums are all-reduced
after the step, and the root ``H`` is the norm of the gradient that stepped.
With the engine's reported (pre-clip) norm ``N`` and the run's clipping ``c``::

    H == N * min(1, c / (N + 1e-6))     (H == N without clipping)

within ``2**-16 * H`` (an engine may sum in float32 in any tree order, DeepSpeed
does, and the clip coefficient and the scaled gradient round a few times more).
A norm computed wrongly and used to clip (the 2.21-instead-of-2.97 of kernels
compiled under another CPU capability), a wrong coefficient, or a clip that did
not happen all break it; a violation fails ``update``, named "(global gradient
norm)". What it cannot see: a *reported* norm that is wrong while the applied
coefficient is right, when both lie above ``c`` (the handed gradient's norm is
``c`` either way, and no number of the training changes).

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
Elements the spec sends exactly (parameters of at most 65,536 elements, everything when
nothing is quantized) must equal the master cast to the working dtype. The worst error over
``scale/2 + 2**-15 scale + two half-ulps`` (the input's and the output's casts) is kept as
context. The shards are checked in bounded pieces of whole groups on every device
(:func:`piece_numel`), with one host synchronisation per shard.

[Note: layout-independent digests]
Two arms may shard differently (the group size changes the padding), so the
harness compares masters and replicas by per-parameter digests that do not
depend on who owns which element: for element ``i`` of a parameter with value
bits ``b``, ``term = ((b xor (i * K1)) * K2) mod 2**32`` (K2 odd), summed over
the elements each rank owns and then over ranks (int64, no overflow below 2**31
elements per parameter). Two parameters that differ in exactly one element
always get different digests (the term is a bijection of ``b`` for fixed
``i``), and any other difference is missed with probability about 2**-32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qwz import kernels
from qwz import shards as seam
from qwz.qualify.evidence import spec
from qwz.qualify.plan import AdamWSettings

K1 = 0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF
K2 = 0x85EBCA6B
MASK32 = 0xFFFFFFFF
FLOAT32_EPS = torch.finfo(torch.float32).eps
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def _all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


CPU_PIECE_NUMEL = 1 << 16
"""Elements per piece of a check on CPU: its temporaries stay in cache."""
DEVICE_PIECE_NUMEL = 1 << 22
"""Elements per piece of a check on an accelerator: a few 16 MiB temporaries at a time,
never whole-shard copies, in pieces large enough that kernel launches do not dominate."""


def piece_numel(device: torch.device, group_size: int = 1) -> int:
    """Elements per piece of a check of tensors on `device`, a whole number of groups of
    `group_size` (at least one group)."""
    numel = CPU_PIECE_NUMEL if device.type == "cpu" else DEVICE_PIECE_NUMEL
    return max(1, numel // group_size) * group_size


def _digest_sum(values: torch.Tensor, first_index: int) -> torch.Tensor:
    """int64 sum of the terms of [Note: layout-independent digests] of flat `values`, whose
    first element is element `first_index` of its parameter.

    The term is computed modulo 2**32 in int32, whose products wrap modulo 2**32 as the
    definition's do; a term read as int32 is its unsigned value minus 2**32 when negative,
    so the unsigned sum is the int32 sum plus 2**32 per negative term."""
    bits = values.detach().float().contiguous().view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    piece = piece_numel(values.device)  # bounded temporaries on every device
    # (j * K1) mod 2**32 for j in a piece, by the same int32 wrap.
    offsets = torch.arange(min(bits.numel(), piece), dtype=torch.int32, device=values.device)
    offsets *= _as_int32(K1 & MASK32)
    for start in range(0, bits.numel(), piece):
        chunk = bits[start : start + piece]
        # ((first + start + j) * K1) mod 2**32 = (first + start) * K1 + j * K1, mod 2**32.
        base = _as_int32(((first_index + start) * K1) & MASK32)
        terms = (offsets[: chunk.numel()] + base) ^ chunk
        terms *= _as_int32(K2)
        total += terms.sum(dtype=torch.int64) + (terms < 0).sum() * (MASK32 + 1)
    return total


def _as_int32(value: int) -> int:
    """`value` in [0, 2**32) as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


@torch.no_grad()
def master_digest_sums(shards: Sequence[seam.OwnShard], names: Sequence[str]) -> torch.Tensor:
    """(len(names),) int64: per parameter, this rank's part of the digest of its fp32 master
    ([Note: layout-independent digests]): the sum over the elements this rank owns (not
    collective)."""
    position = {name: index for index, name in enumerate(names)}
    device = shards[0].master.device if shards else torch.device("cpu")
    sums = torch.zeros(len(names), dtype=torch.int64, device=device)
    for shard in shards:
        master = shard.master.detach().reshape(-1)
        for slot in shard.slots:
            sums[position[slot.name]] += _digest_sum(
                master[slot.start : slot.end], slot.param_offset
            )
    return sums


@torch.no_grad()
def master_digests(shards: Sequence[seam.OwnShard], names: Sequence[str]) -> dict[str, str]:
    """Per parameter, the digest of its fp32 master over all ranks ([Note: layout-independent
    digests]); collective: every rank must call it."""
    sums = _all_reduce(master_digest_sums(shards, names))
    return {name: f"{int(value):016x}" for name, value in zip(names, sums.tolist(), strict=True)}


@torch.no_grad()
def replica_digests(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, int64 digest per parameter) of this rank's working copy (not collective)."""
    names, digests = [], []
    for name, param in module.named_parameters():
        names.append(name)
        digests.append(_digest_sum(param.detach().reshape(-1), 0))
    return names, torch.stack(digests)


@torch.no_grad()
def replica_divergence(module: torch.nn.Module) -> list[str]:
    """Names of the parameters whose working copies differ between ranks (collective)."""
    names, digests = replica_digests(module)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []
    low, high = digests.clone(), digests.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return [name for name, differs in zip(names, (low != high).tolist(), strict=True) if differs]


def exact_masks(
    shards: Sequence[seam.OwnShard],
    group_size: int | None,
    param_numel: dict[str, int],
    gather_ranks: Sequence[int],
) -> list[torch.Tensor]:
    """Per shard, (n,) bool: the elements that must travel exactly whatever the engine says
    -- those of parameters the spec sends exactly (:func:`spec.travels_exactly`), and every
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
    that gives the most, and its other elements are the mismatches."""
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
    magnitude = torch.maximum(master.abs(), working.float().abs())
    # The input's cast and the output's cast each move a value by at most a half-ulp.
    ratio_bound = element_scales * (0.5 + spec.TIE_ALLOWANCE) + 2 * spec.half_ulp(magnitude, dtype)
    return _verdict(master, working, nearest[0], element_scales, mismatch, reference, near_tie,
                    freedom & working_input[chosen], freedom & scale_ulp[chosen], exact,
                    ratio_bound)  # fmt: skip


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
    claims; bounded pieces of whole groups, one host synchronisation per shard."""
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


@dataclass
class UpdateResult:
    """Totals of the update check on one rank for one arm."""

    checked: int = 0
    violations: int = 0
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None
    missing_steps: list[int] = field(default_factory=list)
    """Training steps at which the optimizer did not step exactly once."""
    norm_checked: int = 0
    """Steps whose global gradient norm was recomputed ([Note: global norm check])."""
    norm_violations: int = 0
    norm_max_ratio: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    """fp16: training steps at which this rank's optimizer did not step; whether each was a
    legitimate overflow skip is the evidence's to decide ([Note: overflow pattern])."""


class StepAgreement(NamedTuple):
    """What every rank learns about a step from one all-reduce (:meth:`UpdateCheck.check_norm`)."""

    ranks_stepped: int
    """Ranks whose optimizer stepped."""
    ranks_overflowed: int
    """Ranks whose loss-scaled local gradient held an Inf or NaN (:class:`OverflowWatch`)."""


class UpdateCheck:
    """[Note: exact update check] on a fixed sample of this rank's master elements."""

    def __init__(
        self,
        shards: Sequence[seam.OwnShard],
        optimizer: torch.optim.Optimizer,
        settings: AdamWSettings,
        *,
        samples_per_shard: int,
        seed: int,
        rank: int,
        skips_allowed: bool = False,
    ):
        self.settings = settings
        self.rank = rank
        self.skips_allowed = skips_allowed
        """fp16: a step without an optimizer step is recorded (``skipped_steps``), not a
        violation here; the sampled masters must not have moved across it."""
        self.optimizer = optimizer
        self.shards = list(shards)
        self.samples: list[torch.Tensor] = []
        generator = torch.Generator().manual_seed(seed * 7_919 + rank)
        for shard in self.shards:
            covered = torch.cat(
                [torch.arange(slot.start, slot.end) for slot in shard.slots]
                or [torch.empty(0, dtype=torch.int64)]
            )
            pick = torch.randperm(covered.numel(), generator=generator)[:samples_per_shard]
            self.samples.append(covered[pick].sort().values.to(shard.master.device))
        self.result = UpdateResult()
        self.step = 0
        self._stepped = [0] * len(self.shards)
        """Per shard, the optimizer steps that included it in this training step."""
        self._optimizer_steps = [0] * len(self.shards)
        """Per shard, the optimizer steps taken so far: Adam's step count must equal it."""
        self._values_at_start = self._sampled_masters()
        self._before: dict[int, dict[str, torch.Tensor]] = {}
        self._last_after: dict[int, torch.Tensor] = {}
        self._grad_squares: torch.Tensor | None = None
        """float64 sum of squares of this rank's handed gradients, each shard's when it
        stepped ([Note: one step per param group])."""
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def begin_step(self, step: int) -> None:
        self.step = step
        self._stepped = [0] * len(self.shards)
        self._grad_squares = None

    def _sampled_masters(self) -> list[torch.Tensor]:
        return [
            shard.master.detach().reshape(-1)[index].double().cpu()
            for shard, index in zip(self.shards, self.samples, strict=True)
        ]

    def end_step(self) -> None:
        if self.skips_allowed and not any(self._stepped):
            self.result.skipped_steps.append(self.step)
            self._check_unchanged()
            return
        if any(count != 1 for count in self._stepped):
            self.result.missing_steps.append(self.step)
            self.result.violations += 1
            counts = sorted(set(self._stepped))
            what = f"the optimizer stepped {counts[0]} times"
            if len(counts) > 1:
                what = "the optimizer stepped the shards " + ", ".join(
                    f"{shard.name} {count} times"
                    for shard, count in zip(self.shards, self._stepped, strict=True)
                )
            self._violation(-1, 0, what, math.inf)

    def _stepping(self, optimizer: Any) -> list[int]:
        """[Note: one step per param group]
        DeepSpeed's ZeRO-1/2 steps its torch optimizer once per param group, with
        ``param_groups`` narrowed to that group (two groups, so two calls, with MoE's experts
        apart); qwz's engine steps every shard in one call. So each call judges the shards
        whose masters are in the optimizer's param groups at that call, and each shard must
        be stepped exactly once per training step."""
        present = {id(param) for group in optimizer.param_groups for param in group["params"]}
        return [index for index, shard in enumerate(self.shards) if id(shard.master) in present]

    def _check_step_count(self, shard_index: int, counted: int, when: str, why: str) -> None:
        """Adam's step count of a shard equals the optimizer steps it was observed to take."""
        taken = self._optimizer_steps[shard_index]
        if counted != taken:
            self.result.violations += 1
            what = (
                f"Adam's step count of {self.shards[shard_index].name} is {counted} {when}, "
                f"but the optimizer stepped it {taken} times ({why})"
            )
            self._violation(-1, 0, what, math.inf)

    def _check_unchanged(self) -> None:
        """A step the optimizer did not take leaves every sampled master as it was, and
        Adam's step count too."""
        now_values = self._sampled_masters()
        for shard_index, now in enumerate(now_values):
            counted = self._step_count(self.shards[shard_index].master)
            self._check_step_count(
                shard_index, counted, "after a skipped step", "the skipped step was counted"
            )
            before = self._last_after.get(shard_index, self._values_at_start[shard_index])
            at = self._count(now != before)
            if at is not None:
                what = "master changed on a step the optimizer did not take"
                self._violation(shard_index, int(self.samples[shard_index][at]), what, math.inf)

    def _state(self, param: torch.Tensor, key: str, index: torch.Tensor) -> torch.Tensor:
        state = self.optimizer.state.get(param, {})
        value = state.get(key)
        if value is None:
            return torch.zeros(index.numel(), dtype=torch.float64)
        return value.detach().reshape(-1)[index].double().cpu()

    def _step_count(self, param: torch.Tensor) -> int:
        value = self.optimizer.state.get(param, {}).get("step", 0)
        return int(value.item() if isinstance(value, torch.Tensor) else value)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        active = self._stepping(optimizer)
        squares = _handed_squares([self.shards[index] for index in active])
        self._grad_squares = squares if self._grad_squares is None else self._grad_squares + squares
        self._before = {}
        for shard_index in active:
            self._stepped[shard_index] += 1
            shard, index = self.shards[shard_index], self.samples[shard_index]
            param = shard.master
            grad = param.grad
            counted = self._step_count(param)
            self._check_step_count(
                shard_index, counted, "before this step", "a step counted that was not taken"
            )
            values = param.detach().reshape(-1)[index].double().cpu()
            if shard_index in self._last_after:
                moved = values != self._last_after[shard_index]
                at = self._count(moved)
                if at is not None:
                    what = "master changed outside the optimizer step"
                    self._violation(shard_index, int(index[at]), what, math.inf)
            self._before[shard_index] = {
                "p": values,
                "g": (
                    torch.zeros_like(values)
                    if grad is None
                    else grad.detach().reshape(-1)[index].double().cpu()
                ),
                "m": self._state(param, "exp_avg", index),
                "v": self._state(param, "exp_avg_sq", index),
                "t": torch.tensor(counted + 1),
            }

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        lr, (beta1, beta2), eps, wd = (
            self.settings.lr,
            self.settings.betas,
            self.settings.eps,
            self.settings.weight_decay,
        )
        for shard_index, before in self._before.items():
            index = self.samples[shard_index]
            param = self.shards[shard_index].master
            actual = param.detach().reshape(-1)[index].double().cpu()
            self._last_after[shard_index] = actual
            self._optimizer_steps[shard_index] += 1
            m_new = self._state(param, "exp_avg", index)
            v_new = self._state(param, "exp_avg_sq", index)
            p0, g, m0, v0 = before["p"], before["g"], before["m"], before["v"]
            t = int(before["t"])
            bc1, bc2 = 1 - beta1**t, 1 - beta2**t
            p1 = p0 * (1 - lr * wd)
            m1 = beta1 * m0 + (1 - beta1) * g
            v1 = beta2 * v0 + (1 - beta2) * g * g
            denom = v1.sqrt() / math.sqrt(bc2) + eps
            update = lr / bc1 * m1 / denom
            expected = p1 - update
            moment_terms = lr / bc1 * (beta1 * m0.abs() + (1 - beta1) * g.abs()) / denom
            bound = (
                FLOAT32_EPS * (p1.abs() + expected.abs())
                + 16 * FLOAT32_EPS * (update.abs() + moment_terms)
                + FLOAT32_TINY
            )
            error = (actual - expected).abs()
            ratios = [error / bound]
            ratios.append((m_new - m1).abs() / (8 * FLOAT32_EPS * (m0.abs() + m1.abs()) + 1e-45))
            ratios.append((v_new - v1).abs() / (8 * FLOAT32_EPS * (v0.abs() + v1.abs()) + 1e-45))
            ratio = torch.stack(ratios).amax(dim=0)
            self.result.checked += int(index.numel())
            if ratio.numel():
                worst = float(ratio.max())
                self.result.max_ratio = max(self.result.max_ratio, worst)
                at = self._count(ratio > 1)
                if at is not None:
                    what = (
                        f"expected {float(expected[at]):.9g}, got {float(actual[at]):.9g} "
                        f"(bound {float(bound[at]):.3g})"
                    )
                    self._violation(shard_index, int(index[at]), what, float(ratio[at]))
        self._before = {}

    @torch.no_grad()
    def check_norm(
        self,
        reported_norm: float,
        gradient_clipping: float,
        local_overflow: torch.Tensor | None = None,
    ) -> StepAgreement:
        """[Note: global norm check] for the step just taken; collective: every rank calls it
        after every step on which no rank failed. The same all-reduce counts the ranks that
        stepped and those whose `local_overflow` (:class:`OverflowWatch`) is set."""
        device = self.shards[0].master.device if self.shards else torch.device("cpu")
        squares = self._grad_squares
        local = torch.zeros(3, dtype=torch.float64, device=device)
        if squares is not None:
            local[0] = squares
            local[1] = 1.0  # this rank's optimizer stepped
        if local_overflow is not None:
            local[2] = local_overflow.to(device, torch.float64)
        handed_squares, ranks_stepped, ranks_overflowed = _all_reduce(local).tolist()
        agreement = StepAgreement(int(ranks_stepped), int(ranks_overflowed))
        self._grad_squares = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if int(ranks_stepped) != world or not math.isfinite(reported_norm):
            # A missing step is a violation already (or, in fp16, the evidence's to judge); a
            # non-finite norm ends the arm or belongs to an overflow-skipped step.
            return agreement
        handed = math.sqrt(handed_squares)
        expected, bound = expected_handed_norm(reported_norm, gradient_clipping)
        ratio = abs(handed - expected) / bound
        result = self.result
        result.norm_checked += 1
        result.norm_max_ratio = max(result.norm_max_ratio, ratio)
        if ratio > 1:
            result.norm_violations += 1
            what = (
                f"the optimizer was handed a gradient of global norm {handed:.9g}; the engine "
                f"reports a norm of {reported_norm:.9g}, so with clipping at "
                f"{gradient_clipping:g} it must be {expected:.9g} (bound {bound:.3g})"
            )
            self._violation(-1, 0, what, ratio, parameter="(global gradient norm)")
        return agreement

    def _count(self, bad: torch.Tensor) -> int | None:
        """Add the sampled elements flagged in `bad` to the violations; the first one's
        sample position (None when none is flagged)."""
        if not bool(bad.any()):
            return None
        self.result.violations += int(bad.sum())
        return int(bad.nonzero()[0])

    def _violation(
        self, shard_index: int, position: int, what: str, ratio: float, parameter: str = ""
    ) -> None:
        if self.result.first_violation is not None:
            return
        name, index = (parameter or "(optimizer)", -1)
        if shard_index >= 0:
            name, index = seam.slot_of(self.shards[shard_index], position)
        self.result.first_violation = {
            "step": self.step,
            "rank": self.rank,
            "parameter": name,
            "index": index,
            "what": what,
            "ratio": ratio if math.isfinite(ratio) else None,
        }


class OverflowWatch:
    """[Note: overflow observation]
    fp16 only. What the evidence needs to judge a skipped step ([Note: overflow pattern],
    qualify/evidence/loss_scaling.py), observed through public torch hooks on the objects
    the harness owns -- never the engine's scaler or its overflow flag:

    - the loss scale actually applied: a hook on the loss tensor the harness computed and
      hands to ``train_step``; the gradient that reaches it is the factor the engine
      multiplied the loss by before backward (``d(s * loss)/d loss = s``, exact: a power
      of two in fp32), whatever the engine's scaler says;
    - whether this rank's loss-scaled gradient overflowed: a hook on every model
      parameter sees the gradient autograd computed for it (before any engine hook
      reduces or moves it) and ORs ``not isfinite(grad).all()`` into one device flag --
      no host synchronisation in backward.

    Each rank's gradient is divided by the world size before the fp16 reduction (qwz's
    engine always; DeepSpeed's ZeRO-1/2 with ``reduce_scatter``, its default, which the
    plan's configs keep), so the reduced gradient is finite exactly when every rank's was:
    the step must be skipped on every rank when any rank's flag is set, and taken
    otherwise."""

    def __init__(self, module: torch.nn.Module):
        params = [param for param in module.parameters() if param.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self._scale: torch.Tensor | None = None
        self._handles = [param.register_hook(self._see_gradient) for param in params]

    def _see_gradient(self, grad: torch.Tensor) -> None:
        finite = torch.isfinite(grad).all().to(self._nonfinite.device)
        torch.logical_or(self._nonfinite, ~finite, out=self._nonfinite)

    def _see_scale(self, grad: torch.Tensor) -> None:
        self._scale = grad.detach().float().reshape(()).clone()

    def watch(self, loss: torch.Tensor) -> None:
        """Observe the step whose loss is `loss` (call before ``train_step(loss)``)."""
        self._nonfinite.zero_()
        self._scale = None
        loss.register_hook(self._see_scale)

    @property
    def local_overflow(self) -> torch.Tensor:
        """0-dim bool on the parameters' device: this rank's scaled gradient was not finite."""
        return self._nonfinite

    def applied_scale(self) -> float | None:
        """The factor the loss was multiplied by before backward; None: no gradient reached
        the loss (the engine did not backpropagate through it)."""
        return None if self._scale is None else float(self._scale)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


NORM_RELATIVE_SLACK = 2.0**-16
"""[Note: global norm check]: how far, relative to it, the norm of the handed gradient may
lie from ``min(norm, clip)``."""


def expected_handed_norm(reported_norm: float, gradient_clipping: float) -> tuple[float, float]:
    """(the global norm the clipped gradient must have, the bound on its distance) given the
    engine's reported norm and the run's clipping threshold ([Note: global norm check])."""
    coefficient = 1.0
    if gradient_clipping > 0:
        coefficient = min(1.0, gradient_clipping / (reported_norm + 1e-6))
    expected = reported_norm * coefficient
    return expected, NORM_RELATIVE_SLACK * expected + FLOAT32_TINY


def _handed_squares(shards: Sequence[seam.OwnShard]) -> torch.Tensor:
    """float64 sum of squares of the gradients the optimizer is handed for `shards` (this
    rank's part of the global norm), in bounded pieces, without a host synchronisation."""
    device = shards[0].master.device if shards else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for shard in shards:
        grad = shard.master.grad
        if grad is None:
            continue
        flat = grad.detach().reshape(-1)
        piece = piece_numel(flat.device)
        for start in range(0, flat.numel(), piece):
            widened = flat[start : start + piece].double()  # fp32 squares are exact in fp64
            total += torch.dot(widened, widened)
    return total


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
    if name == "compiled":  # the fused kernels' probes ran: asking costs nothing now
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
