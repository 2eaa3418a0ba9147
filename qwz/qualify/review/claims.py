"""The claims table of a pull request's review: each bullet of the PR's summary, the checks
that decide it, and their verdicts (``qwz-qualify review``, qualify/pr_review/).

[Note: claims and their checks]
The PR (DeepSpeed #8511/#8513) claims a list of things; a review is worth what it checks of
that list. ``CLAIMS`` maps each bullet, in the PR's words, to the check families that decide
it and on which arms -- the one place that mapping is written. A row's verdict is the worst
of its checks under today's rules (FAIL, then INCONCLUSIVE, then PASS; a check with nothing
to test, n/a, decides nothing); "not in this record" where the head's record lacks the
claim's first decider, its own test (a harness that predates the check, or a run without the
arm it needs) -- the deciders after it (control rows of the conformance table) only back it
and never pass a claim alone. Two rows are
the review's own: "default path unchanged" compares the base's and the head's reference arm
([Note: default path unchanged], qualify/evidence/default_path.py), and the speed-up is
reported with its interval, a verdict only where the run was given ``--min-speedup``. The
config rules are the ``conformance`` table's rows (each config run through the subject's own
parser and engine, each row naming the PR claim it tests: [Note: the PR's config rules] in
qualify/evidence/rules/conformance.py): a claim reads the rows of its PR claims at the head, and the
base's verdict of the same rows is shown beside them as context (stock DeepSpeed refuses the
group size key, so its rows differ by design).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import NamedTuple

from qwz.qualify.base.plan import PROPOSAL_GROUP_SIZE, REFERENCE
from qwz.qualify.evidence.default_path import DefaultPath
from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.rules import family_of
from qwz.qualify.evidence.schema import Arm, Check, Record
from qwz.qualify.review.formatting import format_interval, format_sig, format_speedup

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
NOT_IN_RECORD = "not in this record"
NOT_JUDGED = "not judged"
"""The speed-up of a run without ``--min-speedup``: reported, not judged."""
DEFAULT_PATH = "default-path"
"""The review's own comparison of the base's and the head's reference arm (no judge rule)."""
SPEEDUP = "speedup"
GROUP_SIZE_KEY = "zero_quantized_weights_group_size"
SCHEME_CLAIM = "int8 codes from a scheme the contract names (the PR: DeepSpeed's ZeRO++ quantizer)"
"""The row that names the scheme the head wrote and what it cost ([Note: one scheme per run],
qualify/evidence/contract.py; [Note: what a scheme costs])."""
BOUNDED_CLAIM = "bounded staging"
"""The row that shows, per candidate, the wire's figure and the memory's side by side."""

ARMS = {
    "candidates": "every candidate arm",
    "key-omitted": f"the candidates whose config leaves {GROUP_SIZE_KEY} out (the default, "
    f"{PROPOSAL_GROUP_SIZE})",
    "non-default": f"the candidates whose group size is not {PROPOSAL_GROUP_SIZE}",
    "every arm": "every arm",
    "run": "the run (a check of no arm)",
}
"""Which of a record's checks of a family decide a claim."""


@dataclass(frozen=True)
class Decider:
    """A check family that decides (part of) a claim, and on which arms (``ARMS``)."""

    family: str
    arms: str = "candidates"
    rows: tuple[str, ...] = ()
    """conformance: the PR claims (the ``claim`` of the table's rows, [Note: the PR's config
    rules] in qualify/evidence/rules/conformance.py) whose rows decide this claim."""


@dataclass(frozen=True)
class Claim:
    claim: str
    """The bullet, in the PR summary's words."""
    deciders: tuple[Decider, ...]


def _conformance(*claims: str) -> Decider:
    return Decider("conformance", "run", claims)


CLAIMS: tuple[Claim, ...] = (
    Claim("ZeRO-1/2 honour zero_quantized_weights", (Decider("in-effect"),)),
    Claim(
        "64-element symmetric int8 groups; default 64",
        (Decider("probe", "key-omitted"), _conformance("8513-default")),
    ),
    Claim(SCHEME_CLAIM, (Decider("own-shard"),)),
    Claim(BOUNDED_CLAIM, (Decider("bounded"),)),
    Claim("small parameters exact", (Decider("own-shard"),)),
    Claim("replicas identical", (Decider("replicas", "every arm"),)),
    Claim("group sizes: positive multiples of 8", (_conformance("8513-multiple-of-8"),)),
    Claim("non-default group size rejected with ZeRO-3", (_conformance("8513-zero-3"),)),
    Claim(
        "FP32 and ZenFlow rejected with quantized weights",
        (_conformance("8511-fp32", "8511-zenflow"),),
    ),
    Claim("group size forwarded through engine and optimizer", (Decider("probe", "non-default"),)),
    Claim(
        "default path unchanged",
        (Decider(DEFAULT_PATH, "run"), _conformance("8511-default-path")),
    ),
    Claim("speed-up [interval]", (Decider(SPEEDUP),)),
)
"""[Note: claims and their checks]."""


def judged_families() -> set[str]:
    """Every check family ``CLAIMS`` names that a judge rule derives (not the review's own)."""
    return {d.family for claim in CLAIMS for d in claim.deciders} - {DEFAULT_PATH}


class ClaimRow(NamedTuple):
    claim: str
    checks: tuple[str, ...]
    """The checks that decided it (their names), or the families it needs where none is in
    the record."""
    verdict: str
    """PASS, FAIL, INCONCLUSIVE, "not in this record" or "not judged"."""
    detail: str


def _arm_of(name: str) -> str | None:
    return name[name.index("[") + 1 : -1] if "[" in name else None


def _arm_names(record: Record, arms: str) -> set[str] | None:
    """The arms `arms` selects in `record`; None for any (a check of the run)."""
    candidates = [arm for arm in record.arms if arm.role == "candidate"]
    if arms == "run":
        return None
    if arms == "every arm":
        return {arm.name for arm in record.arms}
    if arms == "key-omitted":
        candidates = [arm for arm in candidates if GROUP_SIZE_KEY not in _zero(arm)]
    elif arms == "non-default":
        candidates = [arm for arm in candidates if arm.group_size != PROPOSAL_GROUP_SIZE]
    return {arm.name for arm in candidates}


def _zero(arm: Arm) -> dict:
    return arm.config.get("zero_optimization", {})


def selected(record: Record, decider: Decider) -> list[Check]:
    """The record's checks, under today's rules, that `decider` names."""
    arms = _arm_names(record, decider.arms)
    return [
        check
        for check in rejudged(record).checks
        if family_of(check.name) == decider.family and (arms is None or _arm_of(check.name) in arms)
    ]


def worst(statuses: list[str]) -> str:
    """FAIL, else INCONCLUSIVE, else PASS; INCONCLUSIVE for nothing that tested anything."""
    if FAIL in statuses:
        return FAIL
    if INCONCLUSIVE in statuses or PASS not in statuses:
        return INCONCLUSIVE
    return PASS


def _status(check: Check) -> str:
    return {"pass": PASS, "fail": FAIL, "inconclusive": INCONCLUSIVE}.get(check.status, "n/a")


ROW_VERDICTS = {"pass": PASS, "fail": FAIL, "not observed": INCONCLUSIVE}
ROW_VERDICTS["other config"] = INCONCLUSIVE
"""A conformance row's verdict as a claim's; the others (open, unattributable, a row unknown
to today's table) are context, deciding nothing ([Note: the PR's config rules])."""


def _rows_of(check: Check, claims: tuple[str, ...]) -> list[dict]:
    """The conformance table's rows (``numbers["rows"]``) of the PR claims `claims`."""
    rows = check.numbers.get("rows")
    if not isinstance(rows, list):
        return []
    return [row for row in rows if isinstance(row, dict) and row.get("claim") in claims]


def _row_text(row: dict) -> str:
    said = f"{row.get('expected')}, {row.get('observed') or 'not observed'}"
    return f"{row.get('row')} ({said}): {row.get('verdict')}"


class _Found(NamedTuple):
    """What one decider found in a record: check names, their verdicts, and a line each."""

    names: list[str]
    statuses: list[str]
    lines: list[str]


def _found_checks(record: Record, decider: Decider) -> _Found:
    found = _Found([], [], [])
    for check in selected(record, decider):
        found.names.append(check.name)
        rows = _rows_of(check, decider.rows) if decider.rows else []
        if rows:
            found.statuses.extend(ROW_VERDICTS.get(str(row.get("verdict")), "n/a") for row in rows)
            found.lines.extend(f"{check.name} row {_row_text(row)}" for row in rows)
        else:
            found.statuses.append(_status(check))
            found.lines.append(f"{check.name}: {check.detail}")
    return found


def _found_default_path(default_path: DefaultPath | None) -> _Found:
    if default_path is None:
        return _Found([], [], [])
    verdict = {"pass": PASS, "fail": FAIL}.get(default_path.status, INCONCLUSIVE)
    return _Found([DEFAULT_PATH], [verdict], [f"{DEFAULT_PATH}: {default_path.detail}"])


def _wanted(decider: Decider) -> str:
    return decider.family if decider.arms == "run" else f"{decider.family}[{decider.arms}]"


def _detail(verdict: str, lines: list[str], statuses: list[str]) -> str:
    """The lines of the checks that decided the verdict (the failing ones for a FAIL)."""
    if verdict in (FAIL, INCONCLUSIVE):
        lines = [line for line, status in zip(lines, statuses, strict=True) if status == verdict]
    text = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
    return text if len(text) <= 400 else text[:397] + "..."


def _decided_row(
    claim: Claim, head: Record, base: Record | None, default_path: DefaultPath | None
) -> ClaimRow:
    """A claim decided by its checks at the head (the review's default-path comparison among
    them); for a check of the run (conformance), the base's beside it as context."""
    found, missing, context = _Found([], [], []), [], []
    for decider in claim.deciders:
        if decider.family == DEFAULT_PATH:
            this = _found_default_path(default_path)
        else:
            this = _found_checks(head, decider)
        if not this.names:
            missing.append(_wanted(decider))
        for kept, more in zip(found, this, strict=True):
            kept.extend(more)
        if base is not None and decider.arms == "run" and decider.family != DEFAULT_PATH:
            at_base = _found_checks(base, decider)
            if at_base.names:
                context.append(f"base: {worst(at_base.statuses)}")
    if not found.names or _wanted(claim.deciders[0]) in missing:
        # The first decider is the claim's own test; the others (control rows) only back it.
        detail = f"{', '.join(missing)}: no such check in the head's record"
        return ClaimRow(claim.claim, tuple(missing), NOT_IN_RECORD, detail)
    verdict = worst(found.statuses)
    detail = _detail(verdict, found.lines, found.statuses)
    if missing:
        detail += f" ({', '.join(missing)}: not in this record)"
    if context:
        detail += f" [{'; '.join(context)}: context]"
    return ClaimRow(claim.claim, tuple(found.names), verdict, detail)


def _median_ms(times: list[float]) -> str:
    return f"{format_sig(statistics.median(times) * 1e3)} ms/step"


def _step_context(head: Record, base: Record | None) -> str:
    """The reference's median step time at the head (its blocks against the candidates) and
    at the base (the A/A blocks of its own run, another process): context only."""
    parts = []
    head_times = [t for p in head.performance for b in p.blocks for t in b.reference_times_s]
    if head_times:
        parts.append(f"head reference {_median_ms(head_times)}")
    # The A/A blocks of the reference alone ([Note: the base runs the reference alone]).
    base_times = [
        t
        for p in (base.performance if base is not None else [])
        if p.arm == REFERENCE
        for b in p.blocks
        for t in b.reference_times_s
    ]
    if base_times:
        parts.append(
            f"base reference {_median_ms(base_times)} (its own run, another process: context only)"
        )
    return "; ".join(parts)


def _interval(performance) -> str:
    if performance.median_speedup is None or performance.ci_low is None:
        return f"{performance.arm}: {performance.ci_method}"
    interval = format_interval(performance.ci_low, performance.ci_high)
    return f"{performance.arm} {format_speedup(performance.median_speedup)} {interval}"


def _speed_row(claim: Claim, head: Record, base: Record | None) -> ClaimRow:
    """The head's candidates' speed-up intervals; a verdict only with ``--min-speedup``."""
    candidates = {arm.name for arm in head.arms if arm.role == "candidate"}
    performance = [p for p in rejudged(head).performance if p.arm in candidates]
    if not performance:
        detail = "no speed blocks of a candidate in the head's record (--blocks 0?)"
        return ClaimRow(claim.claim, (SPEEDUP,), NOT_IN_RECORD, detail)
    detail = "; ".join(_interval(item) for item in performance)
    context = _step_context(head, base)
    detail += f" [{context}]" if context else ""
    if head.plan.min_speedup is None:
        return ClaimRow(claim.claim, (SPEEDUP,), NOT_JUDGED, f"{detail} (no --min-speedup)")
    row = _decided_row(claim, head, None, None)
    return row._replace(detail=f"{row.detail} [{detail}]")


def _scheme_row(claim: Claim, head: Record) -> ClaimRow:
    """``own-shard`` decides it; where it passes, the detail is the scheme the head wrote and
    what it cost on this run, for a reviewer who may ask for a better one."""
    from qwz.qualify.evidence.rules.schemes import scheme_report

    row = _decided_row(claim, head, None, None)
    # [Note: a CUDA-only subject on a CPU runner]: the verdict covers the plumbing only.
    substituted = "".join(f"{op}; " for op in head.subject.substituted_ops)
    if row.verdict != PASS:
        return row._replace(detail=substituted + row.detail)
    return row._replace(detail=substituted + scheme_report(head).sentence())


def _bounded_figures(check: Check) -> str:
    numbers = check.numbers
    wire = (
        f"largest collective {numbers['largest_output_bytes']:,} B of {numbers['bound_bytes']:,} B"
        if {"largest_output_bytes", "bound_bytes"} <= numbers.keys()
        else "wire not judged"
    )
    memory = (
        f"gather memory {numbers['staging_excess_bytes']:,} B of "
        f"{numbers['staging_allowance_bytes']:,} B"
        if {"staging_excess_bytes", "staging_allowance_bytes"} <= numbers.keys()
        else "gather memory not observed"
    )
    return f"{_arm_of(check.name)}: {wire}; {memory}"


def _bounded_row(claim: Claim, head: Record) -> ClaimRow:
    """``bounded`` decides it; the detail shows each candidate's wire figure beside its
    memory figure ([Note: the gather's memory, exactly], qualify/evidence/staging.py), and a
    failing check's own words."""
    row = _decided_row(claim, head, None, None)
    checks = [check for check in selected(head, claim.deciders[0]) if check.status == "pass"]
    if row.verdict != PASS or not checks:
        return row
    return row._replace(detail="; ".join(_bounded_figures(check) for check in checks))


def claims_table(
    head: Record, base: Record | None, default_path: DefaultPath | None
) -> list[ClaimRow]:
    """A row per claim of ``CLAIMS`` ([Note: claims and their checks])."""
    rows = []
    for claim in CLAIMS:
        if any(decider.family == SPEEDUP for decider in claim.deciders):
            rows.append(_speed_row(claim, head, base))
        elif claim.claim == SCHEME_CLAIM:
            rows.append(_scheme_row(claim, head))
        elif claim.claim == BOUNDED_CLAIM:
            rows.append(_bounded_row(claim, head))
        else:
            rows.append(_decided_row(claim, head, base, default_path))
    return rows
