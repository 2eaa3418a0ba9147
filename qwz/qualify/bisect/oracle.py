"""The oracles: good, bad or skip for one commit, from its record (pure functions of records).

- ``CheckOracle``: bad when one of the checks under search fails, good when all of them pass;
  the default oracle searches for the checks that failed in the bad head's record.
- ``HashOracle``: bad when the final hashes (every arm, every rank) differ from the good
  head's, good when they are equal: which commit changed the numerics.
- ``SpeedOracle``: bad when a candidate's speed-up interval lies entirely below the good
  head's, good when its median reaches the good head's interval, ambiguous in between
  (re-measured, the measurements pooled; [Note: speed verdicts]).

A record that cannot answer is a skip (``git bisect run``'s exit 125), with the reason: an
INCONCLUSIVE run, a crash that is not the check under search, a check that is n/a.

[Note: a check name]
  ``--check`` takes a check's family (``own-shard``: every arm's own-shard check) or one
  check (``own-shard[candidate-g64]``); the default oracle searches for the exact names that
  failed in the bad head's record.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.rules.speed import summarize_blocks
from qwz.qualify.evidence.schema import Record

CHECK_FAMILIES = (
    "finite", "step1-exact", "update", "own-shard", "replicas", "reproduced", "probe",
    "in-effect", "learning", "speedup",
)  # fmt: skip
"""The checks of qualify/evidence/checks.py, by family ([Note: a check name])."""
CRASH_KINDS = ("crash", "error", "not-run")


class Judgement(NamedTuple):
    verdict: str
    """"good", "bad", "skip", or (speed only) "ambiguous": measure again."""
    why: str


def _matches(check_name: str, target: str) -> bool:
    return check_name == target or check_name.split("[", 1)[0] == target


def unknown_check(name: str) -> str | None:
    """Why `name` names no check ([Note: a check name]); None when it does."""
    family = name.split("[", 1)[0]
    if family in CHECK_FAMILIES and (
        family == name or (name.endswith("]") and len(name) > len(family) + 2)
    ):
        return None
    families = ", ".join(CHECK_FAMILIES)
    return f"--check {name!r} names no check: use a family ({families}) or FAMILY[ARM]"


def _crash(record: Record) -> str | None:
    for trajectory in record.trajectories:
        failure = trajectory.failure
        if failure is not None and failure.kind in CRASH_KINDS:
            return (
                f"{trajectory.arm} ended by {failure.kind} at step {failure.step}: "
                + (failure.message.strip().splitlines() or [""])[-1][:200]
            )
    return None


class CheckOracle(NamedTuple):
    targets: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        return {"kind": "check", "checks": list(self.targets)}

    def judge(self, record: Record) -> Judgement:
        """By today's rules ([Note: rejudging]): a commit is bad for what the bisecting judge
        fails, never for what an older judge said."""
        judged = rejudged(record)
        matched = [c for c in judged.checks if any(_matches(c.name, t) for t in self.targets)]
        failed = [check for check in matched if check.status == "fail"]
        if failed:
            first = failed[0]
            return Judgement("bad", f"{', '.join(c.name for c in failed)} fail: {first.detail}")
        if judged.verdict.status == "INCONCLUSIVE":
            return Judgement("skip", f"INCONCLUSIVE: {', '.join(judged.verdict.inconclusive)}")
        crash = _crash(record)
        if crash is not None:
            return Judgement("skip", f"a crash that is not the check under search: {crash}")
        if matched and all(check.status == "pass" for check in matched):
            return Judgement("good", f"{', '.join(c.name for c in matched)} pass")
        states = [f"{check.name} {check.status}" for check in matched]
        found = ", ".join(states) if states else "no such check in the record"
        return Judgement("skip", f"cannot judge {', '.join(self.targets)}: {found}")


def final_hashes(record: Record) -> dict[str, list[str | None]] | str:
    """Every arm's final hash on every rank, or why the record has none to compare."""
    if record.verdict.status == "INCONCLUSIVE":
        return f"INCONCLUSIVE: {', '.join(record.verdict.inconclusive)}"
    crash = _crash(record)
    hashes = {item.arm: list(item.per_rank) for item in record.hashes}
    missing = [arm for arm, per_rank in hashes.items() if None in per_rank]
    if crash is not None or not hashes or missing:
        return crash or f"no final hash of {', '.join(missing) or 'any arm'}"
    return hashes


class HashOracle(NamedTuple):
    reference: dict[str, list[str | None]]
    """The good head's final hashes."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "hash", "good_hashes": self.reference}

    def judge(self, record: Record) -> Judgement:
        hashes = final_hashes(record)
        if isinstance(hashes, str):
            return Judgement("skip", hashes)
        if set(hashes) != set(self.reference):
            return Judgement("skip", f"arms {sorted(hashes)} are not the good head's "
                             f"{sorted(self.reference)}")  # fmt: skip
        differing = [arm for arm in hashes if hashes[arm] != self.reference[arm]]
        if differing:
            shown = ", ".join(f"{arm} {str(hashes[arm][0])[:12]}" for arm in differing)
            return Judgement("bad", f"final hash differs from the good head's: {shown}")
        return Judgement("good", "final hashes equal the good head's")


def speed_intervals(*records: Record) -> dict[str, tuple[float, float, float]] | str:
    """Each candidate's speed-up (ci_low, median, ci_high) over the timed blocks of every one
    of `records` (measurements of one commit, pooled: a re-measured commit's interval
    narrows), or why they give none."""
    blocks: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.verdict.status == "INCONCLUSIVE":
            return f"INCONCLUSIVE: {', '.join(record.verdict.inconclusive)}"
        crash = _crash(record)
        if crash is not None:
            return crash
        for item in record.performance:
            raw = [block.model_dump(mode="json") for block in item.blocks]
            blocks.setdefault(item.arm, []).extend(raw)
    intervals = {}
    for arm, raw in blocks.items():
        summary = summarize_blocks(raw)
        if summary["ci_low"] is None or summary["ci_high"] is None:
            return f"{arm}: no speed-up interval ({summary['ci_method']})"
        intervals[arm] = (summary["ci_low"], summary["median_speedup"], summary["ci_high"])
    return intervals or "no timed candidate (--blocks?)"


def _shown(interval: tuple[float, float, float]) -> str:
    low, median, high = interval
    return f"{median:.3f}x [{low:.3f}, {high:.3f}]"


class SpeedOracle(NamedTuple):
    """[Note: speed verdicts] Bad: the commit's interval lies entirely below the good head's
    (its upper end under the good head's lower end). Good: its median reaches the good
    head's lower end (no slowdown beyond the good head's own uncertainty). In between (a
    median below the good head's interval, an interval reaching into it) the commit is
    ambiguous: it is measured again and its blocks pooled with the earlier ones."""

    reference: dict[str, tuple[float, float, float]]
    """The good head's speed-up intervals, by candidate arm."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "speed", "good_intervals": {a: list(i) for a, i in self.reference.items()}}

    def judge(self, record: Record, earlier: tuple[Record, ...] = ()) -> Judgement:
        """`record`'s verdict, its blocks pooled with those of `earlier` measurements of the
        same commit."""
        intervals = speed_intervals(*earlier, record)
        if isinstance(intervals, str):
            return Judgement("skip", intervals)
        if set(intervals) != set(self.reference):
            return Judgement("skip", f"candidates {sorted(intervals)} are not the good head's")
        verdicts = {}
        for arm, (_, median, high) in intervals.items():
            good_low = self.reference[arm][0]
            verdicts[arm] = (
                "bad" if high < good_low else "good" if median >= good_low else "ambiguous"
            )
        shown = "; ".join(f"{arm} {_shown(intervals[arm])} vs {_shown(self.reference[arm])}"
                          for arm in intervals)  # fmt: skip
        if len(earlier):
            shown += f" ({len(earlier) + 1} measurements pooled)"
        for verdict in ("bad", "ambiguous"):
            if verdict in verdicts.values():
                return Judgement(verdict, shown)
        return Judgement("good", shown)
