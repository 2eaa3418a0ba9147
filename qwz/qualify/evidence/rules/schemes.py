"""``own-shard[arm]``, and which scheme of the contract a run used and what it cost.

The observer (qwz/qualify/run/observers/own_shard.py) counts, per rank, every own-shard
element against the contract's schemes ([Note: one scheme per run], contract.py); this module
judges those counts and says, for a reviewer, which scheme the subject wrote and what it cost
on this run ([Note: what a scheme costs], qwz/qualify/run/observers/scheme_cost.py). Pure
functions of a record.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from qwz.qualify.evidence.contract import ABSMAX_127, SCHEME_SHORT, SCHEME_TEXT, ZEROPP
from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Check, OwnShards, Record, SchemeCost
from qwz.qualify.evidence.zeropp import FP16_MAX

BEFORE_SCHEMES = "absmax/127 (judged when it was the contract's only scheme)"


class RunScheme(NamedTuple):
    """The schemes a run's quantized arms wrote, arm by arm."""

    by_arm: dict[str, frozenset[str]]
    """Arm -> the schemes its ranks identified or accounted elements to (empty: none told)."""

    @property
    def schemes(self) -> frozenset[str]:
        return frozenset().union(*self.by_arm.values()) if self.by_arm else frozenset()

    @property
    def mixed(self) -> bool:
        return len(self.schemes) > 1

    @property
    def scheme(self) -> str | None:
        """The run's one scheme; None where none was told apart or several were used."""
        return next(iter(self.schemes)) if len(self.schemes) == 1 else None


def arm_schemes(own: OwnShards) -> frozenset[str]:
    """The schemes one arm's ranks wrote (an older record's: absmax/127, the only one then)."""
    if not own.scheme_by_rank and own.checked and not own.by_scheme:
        return frozenset({ABSMAX_127})
    named = {scheme for scheme in own.scheme_by_rank if scheme is not None}
    return frozenset(named | {scheme for scheme, count in own.by_scheme.items() if count > 0})


def run_scheme(record: Record) -> RunScheme:
    quantized = {arm.name for arm in record.arms if arm.quantized}
    return RunScheme(
        {own.arm: arm_schemes(own) for own in record.own_shards if own.arm in quantized}
    )


def _kernel_fallbacks(own: OwnShards) -> str:
    """The kernel implementations dropped on any rank (the record's ``kernels``), for the
    detail: two implementations that disagree must never pass unseen."""
    reasons = sorted({reason for use in own.kernels for reason in use.fallbacks})
    return f"; kernel fallbacks: {'; '.join(reasons)}" if reasons else ""


def _rule_text(schemes: frozenset[str], quantized: bool) -> str:
    if not quantized:
        return "its fp32 master cast to the working dtype"
    if len(schemes) == 1:
        (scheme,) = schemes
        return f"a decode of its fp32 master the contract allows under {SCHEME_TEXT[scheme]}"
    return (
        "a decode of its fp32 master the contract allows under one of its schemes "
        "([Note: the contract and its freedoms], qwz/qualify/evidence/spec.py)"
    )


@rule("own-shard", 3)
def own_shard(own: OwnShards, quantized: bool, failure: Any, run: RunScheme) -> Check:
    """[Note: own shard against the spec] (qualify/run/observers/own_shard.py): every element
    a decode one scheme of the contract allows (or the exact cast where the spec sends it
    exactly), one scheme on every rank and arm, and no weight beyond what the scheme holds."""
    name = f"own-shard[{own.arm}]"
    fallbacks = _kernel_fallbacks(own)
    if own.fp16_overflow:  # evidence even where the NaN it makes ends the arm later
        return check(
            name, "fail",
            f"{own.fp16_overflow} own-shard elements lie in groups holding a weight beyond "
            f"fp16's range (|x| > {FP16_MAX:g}): {SCHEME_SHORT[ZEROPP]} stages its input in "
            "fp16, where such a weight becomes infinite and its whole group decodes to NaN "
            f"([Note: DeepSpeed's ZeRO++ scheme], qwz/qualify/evidence/zeropp.py){fallbacks}",
            fp16_overflow=own.fp16_overflow,
        )  # fmt: skip
    if failure is not None and own.first_violation is None:
        return check(name, "n/a", "the arm failed; see finite")
    if own.checked == 0 and own.first_violation is None:
        return check(name, "n/a", "no own-shard element was observed")
    schemes = arm_schemes(own) if quantized else frozenset()
    rule_text = _rule_text(schemes, quantized)
    if own.mismatches or own.first_violation is not None:
        first = own.first_violation
        where = f"; first at {_where(first)}: {first.what}" if first else ""
        return check(
            name, "fail",
            f"{own.mismatches} of {own.checked} own-shard elements are not {rule_text}"
            f"{where}{fallbacks}",
            mismatches=own.mismatches, max_ratio=own.max_ratio,
        )  # fmt: skip
    if quantized and run.mixed:
        return check(
            name, "fail",
            f"the run mixes the contract's schemes ({_mix(run)}): a PR calls one quantizer, so "
            "two mean two code paths that quantize differently ([Note: one scheme per run], "
            f"qwz/qualify/evidence/contract.py){fallbacks}",
            schemes=sorted(run.schemes), by_scheme=dict(sorted(own.by_scheme.items())),
        )  # fmt: skip
    scheme = next(iter(schemes)) if len(schemes) == 1 else None
    return check(
        name, "pass",
        f"after every step all {own.checked} own-shard elements are {rule_text}, parameters "
        f"of at most 65,536 elements exact{_identified(own, scheme, quantized)}"
        f"{_freedoms_used(own)} (worst error {format(own.max_ratio or 0.0, '.4g')} of "
        f"scale/2 + allowance + half-ulps){fallbacks}",
        checked=own.checked, near_ties=own.near_ties, max_ratio=own.max_ratio,
        **({} if own.reference is None else {"reference": own.reference}),
        working_input=own.working_input, scale_ulp=own.scale_ulp,
        unrounded_decode=own.unrounded_decode, scheme=scheme,
    )  # fmt: skip


def _where(violation) -> str:
    index = f"[{violation.index}]" if violation.index >= 0 else ""
    return f"step {violation.step}, rank {violation.rank}, {violation.parameter}{index}"


def _mix(run: RunScheme) -> str:
    return "; ".join(
        f"{arm}: {' and '.join(SCHEME_SHORT[scheme] for scheme in sorted(schemes))}"
        for arm, schemes in sorted(run.by_arm.items())
        if schemes
    )


def _identified(own: OwnShards, scheme: str | None, quantized: bool) -> str:
    if not quantized:
        return ""
    if scheme is None:
        return "; no element told the contract's schemes apart"
    if not own.scheme_by_rank:
        return f"; scheme {BEFORE_SCHEMES}"
    return f"; scheme identified: {SCHEME_SHORT[scheme]} on every rank"


def _freedoms_used(own: OwnShards) -> str:
    """How many own-shard elements were their scheme's reference arithmetic bit for bit, and
    which freedom of [Note: the contract and its freedoms] (qualify/evidence/spec.py) the
    others used; empty when all were the reference (or an older record counted nothing)."""
    used = [
        f"{count} {what}"
        for count, what in (
            (own.working_input, "from the master cast to the working dtype"),
            (own.scale_ulp, "with a scale one fp32 ulp from absmax/127"),
            (own.unrounded_decode, "decoded without rounding through fp16"),
            (own.near_ties, "near-ties that took the other neighbouring code or rounding"),
        )
        if count
    ]
    reference = "" if own.reference is None else f"{own.reference} bit for bit the reference; "
    if not used:
        return f"; {reference.removesuffix('; ')}" if reference else ""
    return f"; {reference}{', '.join(used)} (allowed by the contract)"


# ------------------------------------------------------------------ what it cost


class SchemeReport(NamedTuple):
    """For a reviewer: the run's scheme and what it cost, merged over its quantized arms."""

    scheme: str | None
    mixed: bool
    cost: SchemeCost | None
    arm: str | None
    """The arm the cost is of (the first quantized arm that measured one)."""

    def sentence(self, learning: str | None = None) -> str:
        """ "this PR uses DeepSpeed's ZeRO++ quantizer; it clips ..." for the report's first
        page; `learning` (the loss gap against its margin) is appended where given."""
        if self.mixed:
            return "the subject wrote two of the contract's schemes in one run (own-shard FAILs)"
        if self.scheme is None:
            return "no quantized element told the contract's schemes apart"
        parts = [f"the subject quantizes with {SCHEME_TEXT[self.scheme]}"]
        if self.scheme == ZEROPP:
            parts.append(
                "it clips each group's positive absmax to 127/128 of itself (worst error "
                "absmax/128, where absmax/127 writes it exactly) and stages weights in fp16"
            )
        if self.cost is not None:
            parts.append(cost_sentence(self.cost))
        if learning:
            parts.append(learning)
        return "; ".join(parts)


def cost_sentence(cost: SchemeCost) -> str:
    """The measured cost in one clause."""
    staging = ""
    if cost.fp16_below_normal or cost.fp16_overflow:
        staging = (
            f"; fp16 staging changes {cost.fp16_below_normal} inputs below its normal range "
            f"and makes {cost.fp16_overflow} infinite"
        )
    return (
        f"on this run's last weights ({cost.elements} quantized elements) its decode error is "
        f"worst {_pct(cost.written_worst)} / mean {_pct(cost.written_mean)} of the group's "
        f"absmax, against absmax/127's {_pct(cost.absmax127_worst)} / "
        f"{_pct(cost.absmax127_mean)} at the same wire bytes and a plain {cost.cast_dtype} "
        f"cast's {_pct(cost.cast_worst)} / {_pct(cost.cast_mean)}{staging}"
    )


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.3g}%"


def scheme_report(record: Record) -> SchemeReport:
    run = run_scheme(record)
    measured = [own for own in record.own_shards if own.arm in run.by_arm and own.cost]
    first = measured[0] if measured else None
    return SchemeReport(
        run.scheme, run.mixed, first.cost if first else None, first.arm if first else None
    )
