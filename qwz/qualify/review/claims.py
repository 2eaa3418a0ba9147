"""The claims table of a pull request's review: each bullet of the PR's summary, the checks
that decide it, and their verdicts (``qwz-qualify review``, qualify/pr_review/).

[Note: claims and their checks]
The PR (DeepSpeed #8511/#8513) claims a list of things; a review is worth what it checks of
that list. ``CLAIMS`` maps each bullet, in the PR's words, to the check families that decide
it and on which arms -- the one place that mapping is written. A row's verdict is the worst
of its checks under today's rules (FAIL, then INCONCLUSIVE, then PASS; a check with nothing
to test, n/a, decides nothing); "not in this record" where the head's record holds none of
them (a harness that predates the check, or a run without the arm it needs). Two rows are
the review's own: "default path unchanged" compares the base's and the head's reference arm
([Note: default path unchanged], qualify/evidence/default_path.py), and the speed-up is
reported with its interval, a verdict only where the run was given ``--min-speedup``. The
conformance rows (the config rules, run through the subject's own parser and engine) are
read at the head; the base's conformance is shown beside them as context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from qwz.qualify.evidence.default_path import DefaultPath
from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.rules import family_of
from qwz.qualify.evidence.schema import Arm, Check, Record
from qwz.qualify.plan import PROPOSAL_GROUP_SIZE
from qwz.qualify.review.formatting import format_interval, format_sig, format_speedup

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
NOT_IN_RECORD = "not in this record"
NOT_JUDGED = "not judged"
"""The speed-up of a run without ``--min-speedup``: reported, not judged."""
DEFAULT_PATH = "default-path"
"""The review's own comparison of the base's and the head's reference arm (no judge rule)."""
SPEEDUP = "speedup"
GROUP_SIZE_KEY = "zero_quantized_weights_group_size"

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
    """conformance: the words of the table's rows this claim reads (its row ids or a phrase
    of their text); empty: every row."""


@dataclass(frozen=True)
class Claim:
    claim: str
    """The bullet, in the PR summary's words."""
    deciders: tuple[Decider, ...]


CLAIMS: tuple[Claim, ...] = (
    Claim("ZeRO-1/2 honour zero_quantized_weights", (Decider("in-effect"),)),
    Claim(
        "64-element symmetric int8 groups; default 64",
        (Decider("probe", "key-omitted"), Decider("conformance", "run", ("omitted",))),
    ),
    Claim("bounded staging", (Decider("bounded"),)),
    Claim("small parameters exact", (Decider("own-shard"),)),
    Claim("replicas identical", (Decider("replicas", "every arm"),)),
    Claim("group sizes: positive multiples of 8", (Decider("conformance", "run", ("multiple",)),)),
    Claim("non-default group size rejected with ZeRO-3", (Decider("conformance", "run", ("3",)),)),
    Claim(
        "FP32 and ZenFlow rejected with quantized weights",
        (Decider("conformance", "run", ("fp32", "zenflow")),),
    ),
    Claim("group size forwarded through engine and optimizer", (Decider("probe", "non-default"),)),
    Claim("default path unchanged", (Decider(DEFAULT_PATH, "run"),)),
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


def _rows_of(check: Check, words: tuple[str, ...]) -> list[dict]:
    """The conformance table's rows (``numbers["rows"]``) any of `words` names."""
    rows = check.numbers.get("rows")
    if not isinstance(rows, list):
        return []
    return [
        row
        for row in rows
        if isinstance(row, dict)
        and any(word.lower() in " ".join(map(str, row.values())).lower() for word in words)
    ]


def _row_status(row: dict) -> str:
    """A conformance row's own verdict: its ``status``, else whether it ``agrees``."""
    status = str(row.get("status", "")).upper()
    if status in (PASS, FAIL, INCONCLUSIVE):
        return status
    agrees = row.get("agrees")
    return "n/a" if agrees is None else (PASS if agrees else FAIL)


class _Found(NamedTuple):
    """What one decider found in a record: check names, their verdicts, and a line each."""

    names: list[str]
    statuses: list[str]
    lines: list[str]


def _found(record: Record, decider: Decider) -> _Found:
    found = _Found([], [], [])
    for check in selected(record, decider):
        found.names.append(check.name)
        rows = _rows_of(check, decider.rows) if decider.rows else []
        if rows:
            found.statuses.extend(_row_status(row) for row in rows)
            found.lines.extend(f"{check.name} row {_row_text(row)}" for row in rows)
        else:
            found.statuses.append(_status(check))
            found.lines.append(f"{check.name}: {check.detail}")
    return found


def _row_text(row: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in row.items())[:160]


def _wanted(decider: Decider) -> str:
    return decider.family if decider.arms == "run" else f"{decider.family}[{decider.arms}]"


def _detail(verdict: str, lines: list[str], statuses: list[str]) -> str:
    """The lines of the checks that decided the verdict (the failing ones for a FAIL)."""
    if verdict in (FAIL, INCONCLUSIVE):
        lines = [line for line, status in zip(lines, statuses, strict=True) if status == verdict]
    text = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
    return text if len(text) <= 400 else text[:397] + "..."


def _checked_row(claim: Claim, head: Record, base: Record | None) -> ClaimRow:
    """A claim decided by judge rules: the head's checks, and the base's as context for a
    check of the run (conformance)."""
    names, statuses, lines, missing = [], [], [], []
    context = []
    for decider in claim.deciders:
        found = _found(head, decider)
        if not found.names:
            missing.append(_wanted(decider))
        names += found.names
        statuses += found.statuses
        lines += found.lines
        if base is not None and decider.arms == "run":
            at_base = _found(base, decider)
            if at_base.names:
                context.append(f"base: {worst(at_base.statuses)}")
    if not names:
        detail = f"{', '.join(missing)}: no such check in the head's record"
        return ClaimRow(claim.claim, tuple(missing), NOT_IN_RECORD, detail)
    verdict = worst(statuses)
    detail = _detail(verdict, lines, statuses)
    if missing:
        detail += f" ({', '.join(missing)}: not in this record)"
    if context:
        detail += f" [{'; '.join(context)}, context]"
    return ClaimRow(claim.claim, tuple(names), verdict, detail)


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _step_context(head: Record, base: Record | None) -> str:
    """The reference's median step time at the head (its blocks against the candidates) and
    at the base (A/A blocks of its own run, another process): context only."""
    head_times = [t for p in head.performance for b in p.blocks for t in b.reference_times_s]
    parts = []
    if head_times:
        parts.append(f"head reference {format_sig(_median(head_times) * 1e3)} ms/step")
    base_times = [
        t
        for p in (base.performance if base is not None else [])
        if p.arm == next(arm.name for arm in base.arms if arm.role == "reference")
        for b in p.blocks
        for t in b.reference_times_s
    ]
    if base_times:
        parts.append(
            f"base reference {format_sig(_median(base_times) * 1e3)} ms/step "
            "(its own run, another process: context only)"
        )
    return "; ".join(parts)


def _speed_row(claim: Claim, head: Record, base: Record | None) -> ClaimRow:
    candidates = {arm.name for arm in head.arms if arm.role == "candidate"}
    performance = [p for p in rejudged(head).performance if p.arm in candidates]
    if not performance:
        detail = "no speed blocks of a candidate in the head's record (--blocks 0?)"
        return ClaimRow(claim.claim, (SPEEDUP,), NOT_IN_RECORD, detail)
    intervals = [
        f"{p.arm} {format_speedup(p.median_speedup)} {format_interval(p.ci_low, p.ci_high)}"
        if p.median_speedup is not None and p.ci_low is not None and p.ci_high is not None
        else f"{p.arm}: {p.ci_method}"
        for p in performance
    ]
    detail = "; ".join(intervals)
    context = _step_context(head, base)
    detail += f" [{context}]" if context else ""
    if head.plan.min_speedup is None:
        return ClaimRow(claim.claim, (SPEEDUP,), NOT_JUDGED, f"{detail} (no --min-speedup)")
    row = _checked_row(claim, head, None)
    return row._replace(detail=f"{row.detail} [{detail}]")


def _default_path_row(claim: Claim, default_path: DefaultPath | None) -> ClaimRow:
    if default_path is None:
        detail = "no base record to compare the head's reference arm with"
        return ClaimRow(claim.claim, (DEFAULT_PATH,), NOT_IN_RECORD, detail)
    verdict = {"pass": PASS, "fail": FAIL}.get(default_path.status, INCONCLUSIVE)
    return ClaimRow(claim.claim, (DEFAULT_PATH,), verdict, default_path.detail)


def claims_table(
    head: Record, base: Record | None, default_path: DefaultPath | None
) -> list[ClaimRow]:
    """A row per claim of ``CLAIMS`` ([Note: claims and their checks])."""
    rows = []
    for claim in CLAIMS:
        families = {decider.family for decider in claim.deciders}
        if DEFAULT_PATH in families:
            rows.append(_default_path_row(claim, default_path))
        elif SPEEDUP in families:
            rows.append(_speed_row(claim, head, base))
        else:
            rows.append(_checked_row(claim, head, base))
    return rows
