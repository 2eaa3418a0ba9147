"""The regression gate: compare a candidate record with a baseline record of the same setup.

Status 0 means no regression, 1 a regression, 2 that the records cannot be
compared (then nothing else is judged: a gate that compares unlike runs
produces noise, not evidence). ``lines`` say why, regressions first.

One judge for both sides ([Note: rejudging], qualify/evidence/rejudge.py): the baseline's and
the candidate's observations are judged by today's rules -- checks, verdicts and speed intervals
re-derived -- so the gate keeps its full power however old the baseline is. What the baseline's
own judge said is reported apart, as a *judge change* ("judge changed: CHECK: PASS (rule 1) /
FAIL under rule 2"), never as a regression; a regression is a change between baseline and
candidate under today's rules (code or environment).

Not comparable: comparable.py's rules (the schema, the environment's fingerprint, the
subject, the workload and the arms).

Regression:
  - a check that passed in the baseline fails or is inconclusive now, or a
    check that the baseline did not have fails (a failing candidate never
    passes the gate just because its check is new); a check that passed and
    is n/a now is reported;
  - an arm's final parameter hash changed although the code and environment
    are the same: both heads clean at the same known SHA, the same subject
    identity (version, commit, dirty flag, diff digest) and the same harness
    commit. Different code (or a dirty checkout) is expected to change hashes:
    that is reported as "numerics changed", not judged;
  - a candidate arm's speed-up interval lies entirely below the baseline's
    (candidate ``ci_high`` < baseline ``ci_low``): the intervals, not the
    medians, so block noise alone does not trip the gate;
  - an arm's peak memory (the largest peak allocation over ranks) grew by
    more than ``memory_growth_pct`` percent.

Everything else that changed (the subject's identity, improvements, loss,
tolerance margins, wire bytes, versions) is listed for information, under
"what changed", after the regressions.
"""

from __future__ import annotations

import enum
import pathlib
from dataclasses import dataclass, field
from typing import NamedTuple

from qwz.qualify.base import exit_codes
from qwz.qualify.evidence.record import load
from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.schema import Check, Record, RecordError
from qwz.qualify.evidence.signing import SigningKey, describe, verifies
from qwz.qualify.review import comparable
from qwz.qualify.review.formatting import (
    format_bytes,
    format_interval,
    format_sig,
    format_speedup,
    short_hash,
)


class Status(enum.IntEnum):
    """The gate's answer, also the exit status of ``qwz-qualify compare``."""

    NO_REGRESSION = exit_codes.PASS
    REGRESSION = exit_codes.FAIL
    NOT_COMPARABLE = exit_codes.REFUSED


@dataclass(frozen=True)
class Comparison:
    status: Status
    """0 no regression, 1 regression, 2 not comparable."""
    lines: list[str] = field(default_factory=list)
    """What changed, human readable: regressions first, then the rest, then the result."""

    def text(self) -> str:
        return "\n".join(self.lines)


class Finding(NamedTuple):
    regression: bool
    text: str


def _note(text: str) -> Finding:
    return Finding(False, text)


def _regression(text: str) -> Finding:
    return Finding(True, text)


# --------------------------------------------------------------------------- #
# Findings
# --------------------------------------------------------------------------- #


def describe_subject(record: Record) -> str:
    """ "deepspeed-native: deepspeed 0.19.8 at 360672f3a9b1 (dirty, diff 4e1f0c2a9d3b)"."""
    subject = record.subject
    package = "qwz" if subject.name == "qwz" else "deepspeed"
    text = f"{subject.name}: {package} {subject.version}"
    if subject.sha:
        text += f" at {short_hash(subject.sha)}"
        if subject.dirty:
            text += f" (dirty, diff {short_hash(subject.diff_sha256)})"
    elif subject.direct_url:
        text += f" from {subject.direct_url.get('url', '?')}"
    else:
        text += " (no checkout: the version alone names it)"
    return text


def _context(baseline: Record, candidate: Record) -> list[Finding]:
    findings = []
    verdicts = [rejudged(r).verdict.status for r in (baseline, candidate)]
    findings.append(_note(f"verdict: {verdicts[0]} -> {verdicts[1]}"))
    for role, record in (("baseline", baseline), ("candidate", candidate)):
        if record.upgraded_from is not None:
            findings.append(
                _note(f"the {role} was written in schema {record.upgraded_from} (read upgraded)")
            )
    machine = comparable.environments(baseline, candidate)[1]
    findings += [_note(f"{line} (context, not part of the fingerprint)") for line in machine]
    if baseline.subject.identity() != candidate.subject.identity():
        findings.append(
            _note(f"subject changed: {describe_subject(baseline)} -> {describe_subject(candidate)}")
        )
    harness = [record.harness.sha if record.harness else None for record in (baseline, candidate)]
    for label, before, after in (
        ("head", baseline.head.sha, candidate.head.sha),
        ("harness (qwz) head", *harness),
        ("subject version", baseline.subject.version, candidate.subject.version),
        ("platform", baseline.environment.platform, candidate.environment.platform),
        ("parameters", baseline.workload.num_parameters, candidate.workload.num_parameters),
    ):
        if before != after:
            findings.append(_note(f"{label} changed: {before} -> {after}"))
    return findings


def judge_changes(role: str, record: Record) -> list[Finding]:
    """``judge changed: ...`` for every check of ``record`` its own judge judged by another
    rule version than today's (or that only one of them derives), and its speed summaries."""
    judged = rejudged(record)
    findings = [
        _note(f"judge changed: {role}: {item.text()}")
        for item in judged.judge_changes
        if item.stored is None or item.stored.rule != 0 or item.result_changed
    ]
    unversioned = [
        item.name
        for item in judged.judge_changes
        if item.stored is not None and item.stored.rule == 0 and not item.result_changed
    ]
    if unversioned:
        findings.append(
            _note(
                f"judge changed: {role}: {len(unversioned)} checks judged before rules were "
                "versioned (rule 0, schema 2) give the same result under today's rules: "
                + ", ".join(unversioned)
            )
        )
    findings += [_note(f"judge changed: {role}: {line}") for line in judged.speed_changed]
    if judged.verdict.status != record.verdict.status:
        findings.append(
            _note(
                f"judge changed: {role}: verdict {record.verdict.status} as judged / "
                f"{judged.verdict.status} under today's rules"
            )
        )
    return findings


def _checks(baseline: Record, candidate: Record) -> list[Finding]:
    """Under today's rules on both sides: pass -> fail or inconclusive is a regression, and so
    is a new failing check; pass -> n/a is reported (the check had nothing to test this time).
    A check failing on both sides under today's rules that the baseline's own judge passed is
    a judge change, not a regression."""
    findings = []
    as_judged = {check.name: check for check in baseline.checks}
    before = {check.name: check for check in rejudged(baseline).checks}
    after = {check.name: check for check in rejudged(candidate).checks}
    bad = ("fail", "inconclusive")
    for name, check in after.items():
        previous = before.get(name)
        was = previous.status if previous else None
        if check.status in bad:
            if previous is None:
                findings.append(
                    _regression(
                        f"check {name!r} is {check.status} (new, not in the baseline): "
                        f"{check.detail}"
                    )
                )
            elif was not in bad:
                findings.append(
                    _regression(
                        f"check {name!r} was {was} in the baseline and is {check.status} now: "
                        f"{check.detail}"
                    )
                )
            else:
                old: Check | None = as_judged.get(name)
                if old is not None and old.status not in bad:
                    findings.append(
                        _note(
                            f"judge changed: check {name!r} {old.status} in the baseline as "
                            f"judged ({_rule(old)}), {check.status} under rule {check.rule} on "
                            "both sides: the judge changed, not the code"
                        )
                    )
                findings.append(_note(f"check {name!r} still {check.status}: {check.detail}"))
        elif check.status == "n/a":
            if was == "pass":
                findings.append(
                    _note(f"check {name!r} passed in the baseline, n/a now: {check.detail}")
                )
        elif previous is None:
            findings.append(_note(f"check {name!r} is new and passes"))
        elif was in bad:
            findings.append(
                _note(f"improved: check {name!r} was {was} in the baseline, passes now")
            )
    for name in before.keys() - after.keys():
        findings.append(_note(f"check {name!r} of the baseline is absent from the candidate"))
    return findings


def _rule(check: Check) -> str:
    return "rule 0: unversioned, schema 2" if check.rule == 0 else f"rule {check.rule}"


def _same_code(baseline: Record, candidate: Record) -> tuple[bool, str]:
    """Whether both records ran the same code (the environment is already known equal)."""
    if baseline.head.sha != candidate.head.sha:
        return False, f"head changed {short_hash(baseline.head.sha)} -> " + short_hash(
            candidate.head.sha
        )
    if baseline.head.sha == "unknown":
        return False, "head SHA unknown: the code cannot be identified"
    if baseline.head.dirty or candidate.head.dirty:
        return False, "head dirty: uncommitted changes may differ"
    if baseline.subject.identity() != candidate.subject.identity():
        return False, "subject changed"
    harness = [record.harness.sha if record.harness else None for record in (baseline, candidate)]
    if harness[0] != harness[1]:
        return False, "harness (qwz) head changed"
    return True, ""


def _hashes(baseline: Record, candidate: Record) -> list[Finding]:
    findings = []
    same_code, why = _same_code(baseline, candidate)
    before = {hashes.arm: hashes for hashes in baseline.hashes}
    for hashes in candidate.hashes:
        previous = before.get(hashes.arm)
        if previous is None:
            continue
        old = ", ".join(dict.fromkeys(short_hash(value) for value in previous.per_rank))
        new = ", ".join(dict.fromkeys(short_hash(value) for value in hashes.per_rank))
        if previous.per_rank == hashes.per_rank:
            findings.append(_note(f"final parameter hash of {hashes.arm!r} unchanged ({new})"))
        elif same_code:
            findings.append(
                _regression(
                    f"final parameter hash of {hashes.arm!r} changed although head, subject "
                    f"and environment are the same: {old} -> {new}"
                )
            )
        else:
            findings.append(
                _note(
                    f"numerics changed: final parameter hash of {hashes.arm!r} changed, as "
                    f"expected ({why}): {old} -> {new}"
                )
            )
    return findings


def _speed(baseline: Record, candidate: Record) -> list[Finding]:
    """Both sides' intervals as today's ``speed`` rule derives them from the block times."""
    findings = []
    before = {performance.arm: performance for performance in rejudged(baseline).performance}
    for performance in rejudged(candidate).performance:
        previous = before.get(performance.arm)
        if previous is None:
            findings.append(_note(f"speed-up of {performance.arm!r} has no baseline"))
            continue
        if performance.median_speedup is None or previous.median_speedup is None:
            findings.append(
                _note(
                    f"speed-up of {performance.arm!r} not compared: insufficient blocks for an "
                    "interval in "
                    + ("the candidate" if performance.median_speedup is None else "the baseline")
                )
            )
            continue
        now = (
            f"{format_speedup(performance.median_speedup)} "
            f"{format_interval(performance.ci_low, performance.ci_high)}"
        )
        then = (
            f"{format_speedup(previous.median_speedup)} "
            f"{format_interval(previous.ci_low, previous.ci_high)}"
        )
        if performance.ci_high < previous.ci_low:
            findings.append(
                _regression(
                    f"speed-up of {performance.arm!r} fell: {now}, baseline {then} "
                    "(the interval lies entirely below the baseline's)"
                )
            )
        elif performance.ci_low > previous.ci_high:
            findings.append(
                _note(f"improved: speed-up of {performance.arm!r} rose: {now}, baseline {then}")
            )
        else:
            findings.append(
                _note(
                    f"speed-up of {performance.arm!r} unchanged within the intervals: {now}, "
                    f"baseline {then}"
                )
            )
        plan = ("blocks", "block_steps", "warmup_steps")
        plan_then = (len(previous.blocks), previous.block_steps, previous.warmup_steps)
        plan_now = (len(performance.blocks), performance.block_steps, performance.warmup_steps)
        if plan_then != plan_now:
            findings.append(
                _note(
                    f"timing plan of {performance.arm!r} changed "
                    f"({', '.join(plan)}): {plan_then} -> {plan_now}"
                )
            )
    return findings


def _growth_pct(old_bytes: int, new_bytes: int) -> float:
    if old_bytes == 0:
        return 0.0 if new_bytes == 0 else float("inf")
    return 100.0 * (new_bytes - old_bytes) / old_bytes


def _peak_by_arm(record: Record) -> dict[str, int]:
    """The largest peak allocation over ranks, per arm (each arm measured alone)."""
    peaks: dict[str, int] = {}
    for memory in record.memory:
        peaks[memory.arm] = max(peaks.get(memory.arm, 0), memory.peak_allocated_bytes)
    return peaks


def _memory(baseline: Record, candidate: Record, growth_limit_pct: float) -> list[Finding]:
    findings = []
    before = _peak_by_arm(baseline)
    for arm, new in _peak_by_arm(candidate).items():
        old = before.get(arm)
        if not old or not new:
            continue
        growth_pct = _growth_pct(old, new)
        change = f"{format_bytes(old)} -> {format_bytes(new)} ({growth_pct:+.1f}%)"
        subject = f"peak allocated memory of {arm!r}"
        if growth_pct > growth_limit_pct:
            findings.append(
                _regression(f"{subject} grew more than the {growth_limit_pct:g}% allowed: {change}")
            )
        elif growth_pct < -growth_limit_pct:
            findings.append(_note(f"improved: {subject} shrank {change}"))
        else:
            findings.append(_note(f"{subject} {change}, within {growth_limit_pct:g}%"))
    return findings


def _loss_text(value: float | None) -> str:
    return "non-finite" if value is None else format_sig(value)


def _numbers(baseline: Record, candidate: Record) -> list[Finding]:
    """Changes that checks already judge or that only inform: losses, tolerance, wire bytes."""
    findings = []
    before_losses = {t.arm: t.losses for t in baseline.trajectories}
    for trajectory in candidate.trajectories:
        previous = before_losses.get(trajectory.arm)
        if previous and trajectory.losses and previous != trajectory.losses:
            findings.append(
                _note(
                    f"final loss of {trajectory.arm!r}: {_loss_text(previous[-1])} -> "
                    f"{_loss_text(trajectory.losses[-1])}"
                )
            )
    before_updates = {u.arm: u for u in baseline.updates}
    for updates in candidate.updates:
        previous = before_updates.get(updates.arm)
        if previous and (previous.violations, previous.max_ratio) != (
            updates.violations,
            updates.max_ratio,
        ):
            findings.append(
                _note(
                    f"update check of {updates.arm!r}: violations {previous.violations} -> "
                    f"{updates.violations}, worst ratio {format_sig(previous.max_ratio, 3)} -> "
                    f"{format_sig(updates.max_ratio, 3)}"
                )
            )
    before_probes = {p.arm: p for p in baseline.probes}
    for probe in candidate.probes:
        previous = before_probes.get(probe.arm)
        if previous is None:
            continue
        if previous.reported_group_sizes != probe.reported_group_sizes:
            findings.append(
                _note(
                    f"reported group sizes of {probe.arm!r}: {previous.reported_group_sizes} -> "
                    f"{probe.reported_group_sizes}"
                )
            )
        if previous.gather_bytes_per_step != probe.gather_bytes_per_step:
            findings.append(
                _note(
                    f"gather bytes per step of {probe.arm!r}: "
                    f"{previous.gather_bytes_per_step:,} -> {probe.gather_bytes_per_step:,}"
                )
            )
    return findings


# --------------------------------------------------------------------------- #
# Entry points
# --------------------------------------------------------------------------- #


def compare(baseline: Record, candidate: Record, *, memory_growth_pct: float = 10.0) -> Comparison:
    """Judge ``candidate`` against ``baseline`` (rules in the module docstring)."""
    if not memory_growth_pct >= 0.0:
        raise ValueError(f"memory_growth_pct: {memory_growth_pct!r} is invalid: it must be >= 0")
    header = [
        f"{role}: head {short_hash(item.head.sha)}{' (dirty)' if item.head.dirty else ''}, "
        f"{describe_subject(item)}, {item.created_at}, digest {short_hash(item.digest)}"
        for role, item in (("baseline", baseline), ("candidate", candidate))
    ]
    reasons = comparable.reasons(baseline, candidate)
    if reasons:
        return Comparison(
            Status.NOT_COMPARABLE,
            [
                *header,
                *(f"NOT COMPARABLE: {reason}" for reason in reasons),
                "result: not comparable",
            ],
        )
    findings = [
        *_context(baseline, candidate),
        *judge_changes("baseline", baseline),
        *judge_changes("candidate", candidate),
        *_checks(baseline, candidate),
        *_hashes(baseline, candidate),
        *_speed(baseline, candidate),
        *_memory(baseline, candidate, memory_growth_pct),
        *_numbers(baseline, candidate),
    ]
    regressions = [f"REGRESSION: {f.text}" for f in findings if f.regression]
    notes = ["what changed (reported, not judged):"]
    notes += [f.text for f in findings if not f.regression]
    if regressions:
        count = len(regressions)
        result = f"result: {count} regression{'s' if count != 1 else ''}"
        return Comparison(Status.REGRESSION, [*header, *regressions, *notes, result])
    return Comparison(Status.NO_REGRESSION, [*header, *notes, "result: no regression"])


def compare_files(
    baseline_path: str | pathlib.Path,
    candidate_path: str | pathlib.Path,
    *,
    memory_growth_pct: float = 10.0,
    require_signature: bool = False,
    key: SigningKey | None = None,
) -> Comparison:
    """Load and verify both records (``record.load``), then ``compare``; a record that cannot
    be trusted makes the pair not comparable, with the loader's message.

    With ``require_signature``, each record must carry a signature that ``key`` verifies
    ([Note: digest and signature]); an unsigned or wrongly signed record, or no key, makes
    the pair not comparable."""
    records = []
    for role, path in (("baseline", baseline_path), ("candidate", candidate_path)):
        try:
            loaded = load(path)
        except RecordError as error:
            return Comparison(
                Status.NOT_COMPARABLE,
                [f"NOT COMPARABLE: {role} record rejected: {error}", "result: not comparable"],
            )
        if require_signature and (
            key is None
            or loaded.signature is None
            or not verifies(loaded.digest, loaded.signature, key)
        ):
            why = describe(loaded.digest, loaded.signature, key)
            return Comparison(
                Status.NOT_COMPARABLE,
                [
                    f"NOT COMPARABLE: {role} record {path}: a verified signature is required; "
                    f"it is {why}",
                    "result: not comparable",
                ],
            )
        records.append(loaded)
    return compare(*records, memory_growth_pct=memory_growth_pct)
