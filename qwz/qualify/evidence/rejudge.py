"""A record judged again by today's rules, beside what its own judge said.

[Note: rejudging]
Every stored check is matched by name with the check today's rules derive from the same
observations (checks.derive), and with it its rule version ([Note: rule versions], rules.py):

- same rule version: the two must agree in status and numbers -- integers, strings and
  booleans exactly, floats to ``REL_TOLERANCE`` relative -- or the record is refused: "rule
  unchanged but the result differs: bump the rule version, or the record was altered". The
  detail is presentation and never compared.
- another rule version (a judge change; rule 0 is a record of schema 2, judged before rules were
  versioned): the stored check is kept *as judged* (its digest verified, and its signature where
  it is signed) and today's check is shown beside it. Where today's rule reads an input the
  record's schema lacked (rules.INPUTS), today's check is "not observed" (n/a), not a verdict
  on data the record never had.
- a check only today's rules derive is new; one only the record has was dropped by today's
  judge. Neither is an error.

The speed summaries (family ``speed``) follow the same rule: re-derived from the block times,
equal within the tolerance where the record's ``speed`` rule is today's, else kept as judged
with today's beside them. ``compare`` gates on today's checks and summaries of both sides, and
reports the judge changes apart (review/compare.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qwz.qualify.evidence.checks import derive
from qwz.qualify.evidence.rules import INPUTS, RULES, SPEED, family_of
from qwz.qualify.evidence.rules.speed import summarize_blocks
from qwz.qualify.evidence.schema import Check, Performance, Record, RecordError, Verdict
from qwz.qualify.evidence.seal import verdict_of

REL_TOLERANCE = 1e-9
"""Relative tolerance of a float re-derived under an unchanged rule (a scipy or numpy upgrade
may move the last bits of an interval; anything larger is a changed result)."""
SPEED_FIELDS = ("interval", "median_speedup", "ci_low", "ci_high", "p_value")


def _same(a: Any, b: Any) -> bool:
    """Equal results: ints, strings, bools and None exactly; floats to REL_TOLERANCE."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        return a == b or math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def differences(stored: Check, today: Check) -> list[str]:
    """What differs between two checks' results (status, each number), never the detail."""
    found = [] if stored.status == today.status else [f"status {stored.status} -> {today.status}"]
    for key in sorted(set(stored.numbers) | set(today.numbers)):
        before, after = stored.numbers.get(key, "(absent)"), today.numbers.get(key, "(absent)")
        if not _same(before, after):
            found.append(f"{key} {before!r} -> {after!r}")
    return found


def rule_text(rule: int) -> str:
    return "rule 0: unversioned, schema 2" if rule == 0 else f"rule {rule}"


@dataclass(frozen=True)
class Judgement:
    """One check: as the record's judge stored it, and under today's rule."""

    name: str
    stored: Check | None
    today: Check | None

    @property
    def family(self) -> str:
        return family_of(self.name)

    @property
    def kind(self) -> str:
        """``same`` (one rule, one result), ``changed`` (another rule version), ``new``
        (only today's rules derive it) or ``dropped`` (only the record has it)."""
        if self.stored is None:
            return "new"
        if self.today is None:
            return "dropped"
        return "same" if self.stored.rule == self.today.rule else "changed"

    @property
    def result_changed(self) -> bool:
        if self.stored is None or self.today is None:
            return True
        return bool(differences(self.stored, self.today))

    def text(self) -> str:
        """``learning[candidate-g64]: PASS (rule 1) / FAIL under rule 2``."""
        if self.stored is None:
            assert self.today is not None
            return (
                f"{self.name}: new under {rule_text(self.today.rule)}: {self.today.status.upper()}"
            )
        then = f"{self.stored.status.upper()} ({rule_text(self.stored.rule)})"
        if self.today is None:
            return f"{self.name}: {then} / not derived by today's judge"
        now = f"{self.today.status.upper()} under rule {self.today.rule}"
        changed = differences(self.stored, self.today)
        how = f" ({'; '.join(changed[:4])})" if changed else ", same result"
        return f"{self.name}: {then} / {now}{how}"


@dataclass(frozen=True)
class Rejudged:
    """A record under today's rules (``checks``, ``verdict``, ``performance``) and every
    check's judgement (``judgements``: as judged vs today)."""

    checks: list[Check]
    verdict: Verdict
    performance: list[Performance]
    judgements: list[Judgement]
    speed_changed: list[str]
    """Per arm whose stored speed summary differs from today's rule's: a line saying how."""

    @property
    def judge_changes(self) -> list[Judgement]:
        """Every check judged by another rule version than today's, new, or dropped."""
        return [item for item in self.judgements if item.kind != "same"]

    @property
    def verdict_changed(self) -> bool:
        return bool(self.judge_changes or self.speed_changed)


def _lacks(item: Any, path: str) -> bool:
    """Whether `item` (a dict of the payload) lacks ``field`` or, for ``field[].rest``, any
    of its list's items lacks ``rest``."""
    if not isinstance(item, dict):
        return False
    field, _, rest = path.partition("[].")
    if field not in item:
        return True
    inner = item[field]
    return bool(rest) and isinstance(inner, list) and any(_lacks(entry, rest) for entry in inner)


def _absent(record_payload: dict[str, Any], path: str) -> bool:
    """Whether the raw payload lacks the input ``section``, ``section[].field`` or a field
    deeper down (``probes[].wire[].largest_output_bytes``): absent where any item lacks it."""
    section, _, rest = path.partition("[].")
    value = record_payload.get(section)
    if value is None:
        return True
    if not rest:
        return False
    return any(_lacks(item, rest) for item in value)


def absent_inputs(payload: dict[str, Any]) -> frozenset[str]:
    """Of every rule's inputs (rules.INPUTS), those the raw ``payload`` lacks."""
    return frozenset(path for paths in INPUTS.values() for path in paths if _absent(payload, path))


def _not_observed(check: Check, missing: list[str]) -> Check:
    return Check(
        name=check.name,
        status="n/a",
        detail=f"not observed: the record's schema lacks {', '.join(missing)}, which today's "
        f"rule {check.rule} of {family_of(check.name)!r} reads",
        numbers={"not_observed": missing},
        rule=check.rule,
    )


def _speed(record: Record, where: str) -> tuple[list[Performance], list[str]]:
    judged_by = record.judge.rules.get(SPEED) if record.judge is not None else 0
    performance, changed = [], []
    for item in record.performance:
        expected = summarize_blocks([block.model_dump(mode="json") for block in item.blocks])
        stored = item.model_dump(mode="json")
        wrong = [key for key, value in expected.items() if not _same(stored[key], value)]
        if wrong and judged_by == RULES[SPEED]:
            raise RecordError(
                f"{where}performance of {item.arm!r}: {', '.join(wrong)} do not follow from the "
                f"recorded step times under its rule ({SPEED!r} version {judged_by}): rule "
                "unchanged but the result differs: bump the rule version, or the record was "
                "altered"
            )
        if wrong:
            changed.append(
                f"speed summary of {item.arm!r}: {rule_text(judged_by or 0)} / rule "
                f"{RULES[SPEED]}: "
                + "; ".join(
                    f"{key} {stored[key]!r} -> {expected[key]!r}"
                    for key in wrong
                    if key in SPEED_FIELDS
                )
            )
        performance.append(Performance.model_validate({**stored, **expected}))
    return performance, changed


def rejudge(record: Record, absent: frozenset[str] = frozenset(), where: str = "") -> Rejudged:
    """Judge ``record`` by today's rules ([Note: rejudging]); a RecordError (prefixed with
    ``where``) where a check of an unchanged rule does not follow from the observations."""
    today = []
    for check in derive(record):
        missing = sorted(path for path in INPUTS.get(family_of(check.name), ()) if path in absent)
        today.append(_not_observed(check, missing) if missing else check)
    ours = {check.name: check for check in today}
    theirs = {check.name: check for check in record.checks}
    judgements = []
    for name in [*theirs, *(name for name in ours if name not in theirs)]:
        item = Judgement(name, theirs.get(name), ours.get(name))
        if item.kind == "same" and item.result_changed:
            assert item.stored is not None and item.today is not None
            raise RecordError(
                f"{where}check {name!r} (rule {item.family!r} version {item.stored.rule}): rule "
                "unchanged but the result differs: bump the rule version, or the record was "
                f"altered ({'; '.join(differences(item.stored, item.today)[:4])})"
            )
        judgements.append(item)
    performance, speed_changed = _speed(record, where)
    return Rejudged(today, verdict_of(today), performance, judgements, speed_changed)


def rejudged(record: Record) -> Rejudged:
    """``record`` under today's rules: what load found (cached on the record), else now."""
    cached = record._rejudged
    if cached is not None and cached[0] == id(record):
        return cached[1]
    result = rejudge(record, record._absent)
    record._rejudged = (id(record), result)
    return result


def verdict_text(record: Record) -> str:
    """The verdict as judged, and today's where a rule change moved it, with the checks
    whose result the change moved."""
    today = rejudged(record)
    if today.verdict.status == record.verdict.status:
        return record.verdict.status
    moved = [item.text() for item in today.judge_changes if item.result_changed]
    return (
        f"{record.verdict.status} (as judged) / {today.verdict.status} under today's rules: "
        + "; ".join(moved[:3])
    )
