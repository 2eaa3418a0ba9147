"""The review of a pull request as a reader sees it: ``review.md`` (the claims table on top,
then the default path, the two runs and the request) and ``review.json`` (the same, as data),
and the review's status and exit code (qualify/pr_review/ runs it; claims.py builds the
table).

Exit codes (the project's): 0 PASS, 1 FAIL (a claim or a run failed, or a run crashed),
4 HARNESS-ERROR (a run could not observe its subject, and nothing failed), 3 INCONCLUSIVE
(a claim or a run could not be decided), 2 refused (the request, or a run's own refusal).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.evidence.default_path import DefaultPath
from qwz.qualify.evidence.harness_error import (
    CANNOT_RUN,
    CANNOT_RUN_EXIT,
    HARNESS_ERROR,
    HARNESS_ERROR_EXIT,
)
from qwz.qualify.review import own_tests_section as own_tests
from qwz.qualify.review.claims import FAIL, INCONCLUSIVE, PASS, ClaimRow
from qwz.qualify.review.formatting import table
from qwz.qualify.review.own_tests_section import OwnTests

MARKDOWN, JSON = "review.md", "review.json"
REFUSED = "refused"
EXITS = {
    PASS: 0,
    FAIL: 1,
    INCONCLUSIVE: 3,
    HARNESS_ERROR: HARNESS_ERROR_EXIT,
    CANNOT_RUN: CANNOT_RUN_EXIT,
    REFUSED: 2,
}


class Side(NamedTuple):
    """How one of the two runs ended (qualify/pr_review/children.py)."""

    side: str
    """"base" (the reference arm alone) or "head" (every arm)."""
    ref: str
    sha: str
    status: str
    """PASS, FAIL, INCONCLUSIVE (its record's, under today's rules), HARNESS-ERROR,
    "crashed", "refused", "interrupted" or "not run"."""
    kind: str
    """"ran" (now) or "resumed" (a finished record of the same request, reused)."""
    reason: str
    record: str | None
    """The record's path, relative to the review's directory."""
    digest: str | None
    wall_s: float | None


@dataclasses.dataclass(frozen=True)
class Review:
    request: dict[str, Any]
    sides: tuple[Side, ...]
    claims: tuple[ClaimRow, ...]
    """The claims table: the qualification's rows, then the PR's own tests' ([Note: own
    tests in the claims table], review/own_tests_section.py)."""
    default_path: DefaultPath | None
    own_tests: OwnTests | None = None
    """None in a review written before the step existed."""


def status_of(review: Review) -> str:
    """The worst of the runs' ends and the claims' verdicts (module docstring)."""
    ends = [side.status for side in review.sides]
    verdicts = [row.verdict for row in review.claims]
    if REFUSED in ends:
        return REFUSED
    if FAIL in ends + verdicts or "crashed" in ends:
        return FAIL
    if HARNESS_ERROR in ends + verdicts:
        return HARNESS_ERROR
    if CANNOT_RUN in ends:
        return CANNOT_RUN
    if INCONCLUSIVE in ends + verdicts or any(end not in EXITS for end in ends):
        return INCONCLUSIVE
    return PASS


def exit_code(review: Review) -> int:
    return EXITS[status_of(review)]


def _claims_lines(review: Review) -> list[str]:
    rows = [
        (row.claim, ", ".join(f"`{name}`" for name in row.checks), f"**{row.verdict}**", row.detail)
        for row in review.claims
    ]
    own = {own_tests.COLLECT_CLAIM, own_tests.PASS_CLAIM}
    if all(row.claim in own for row in review.claims):
        return [
            "No claims of the qualification: the head's run has no record.",
            "",
            *(table(("claim", "decided by", "verdict", "detail"), rows) if rows else []),
        ]
    return table(("claim", "decided by", "verdict", "detail"), rows)


def _default_path_lines(default_path: DefaultPath | None) -> list[str]:
    lines = ["## Default path unchanged", ""]
    if default_path is None:
        return [*lines, "Not compared: the base or the head has no record.", ""]
    lines.append(
        "The head's reference arm (`zero_quantized_weights: false`) against the base's, bit "
        "for bit: every step's loss, every step's fp32 masters (per parameter, short "
        "layout-independent digests) and the final hashes."
    )
    lines += ["", f"**{default_path.status.upper()}**: {default_path.detail}", ""]
    if default_path.first is not None:
        first = default_path.first
        where = f"step {first.step}" if first.step is not None else "after the last step"
        lines += [f"First difference: {where}, {first.what}, {first.parameter or '—'}.", ""]
    return lines


def _runs_lines(review: Review) -> list[str]:
    lines = [
        "## Runs",
        "",
        "The base trains the reference arm alone (timed against itself); the head trains every "
        "arm, and times its candidates against its own reference. The base's step times come "
        "from another process: context only, never a speed-up.",
        "",
    ]
    rows = [
        (
            side.side,
            side.ref,
            f"`{side.sha[:12]}`",
            f"**{side.status}**",
            side.kind,
            f"[{side.record}]({side.record})" if side.record else "—",
            f"[report]({pathlib.PurePath(side.record).parent / 'report.md'})"
            if side.record
            else "—",
            side.reason or "—",
        )
        for side in review.sides
    ]
    header = ("run", "ref", "commit", "verdict", "how", "record", "report", "why")
    return lines + table(header, rows)


def render_claims(review: Review) -> str:
    """The claims table alone (what CI summaries show), with the review's status."""
    status = status_of(review)
    lines = [
        "## Claims",
        "",
        f"**{status}** (exit {EXITS[status]}): the worst of the claims' verdicts and the two "
        "runs' ends.",
        "",
        own_tests.summary_line(review.own_tests),
        "",
        *_claims_lines(review),
    ]
    return "\n".join(lines) + "\n"


def render_markdown(review: Review) -> str:
    request = review.request
    lines = [
        f"# Review: {request['base_ref']} → {request['head_ref']} of {request['repository']}",
        "",
        render_claims(review),
        *_default_path_lines(review.default_path),
        *own_tests.section_lines(review.own_tests),
        *_runs_lines(review),
        "## Request",
        "",
        f"- base `{request['base']}`, head `{request['head']}`",
        f"- worktree `{request['worktree']}`",
        f"- run arguments (both runs): `{' '.join(request['run_args'])}`",
        "",
    ]
    return "\n".join(lines)


def summary_data(review: Review) -> dict[str, Any]:
    default_path = review.default_path
    return {
        "status": status_of(review),
        "exit_code": exit_code(review),
        "request": review.request,
        "claims": [row._asdict() for row in review.claims],
        "default_path": None
        if default_path is None
        else {
            "status": default_path.status,
            "detail": default_path.detail,
            "first": None if default_path.first is None else default_path.first._asdict(),
            "compared": list(default_path.compared),
            "not_compared": list(default_path.not_compared),
        },
        "runs": [side._asdict() for side in review.sides],
        "own_tests": own_tests.to_data(review.own_tests),
    }


def write(out: pathlib.Path, review: Review) -> None:
    """``review.md`` and ``review.json`` in `out`, each atomically."""
    atomic_write_text(out / JSON, json.dumps(summary_data(review), indent=2) + "\n")
    atomic_write_text(out / MARKDOWN, render_markdown(review))
