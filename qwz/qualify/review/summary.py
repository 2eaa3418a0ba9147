"""The short markdown of a GitHub job summary: a record's title and banner ([Note: verdict
banner], qualify/review/banner.py) with the checks that did not pass, or compare's gate.
"""

from __future__ import annotations

from qwz.qualify.evidence.schema import Record
from qwz.qualify.review.banner import banner
from qwz.qualify.review.report import title

_MARK = {"pass": "pass", "fail": "**FAIL**", "n/a": "n/a", "inconclusive": "*inconclusive*"}


def record_summary(record: Record) -> str:
    """A record as a job summary: the title, the banner, the checks that did not pass (all
    of them when every one did) and each candidate's speed."""
    lines = [f"### {title(record)}: {banner(record)}", ""]
    lines += [
        f"Head `{record.head.sha[:12]}`{' (dirty)' if record.head.dirty else ''}, workload "
        f"`{record.workload.name}`, {record.environment.world_size} ranks, record digest "
        f"`{record.digest[:12]}`.",
        "",
    ]
    shown = [check for check in record.checks if check.status != "pass"] or record.checks
    passed = sum(check.status == "pass" for check in record.checks)
    lines += [f"{passed} of {len(record.checks)} checks passed.", ""]
    lines += ["| check | result | detail |", "|---|---|---|"]
    lines += [
        f"| `{check.name}` | {_MARK[check.status]} | "
        + check.detail.replace("|", "\\|").replace("\n", " ")
        + " |"
        for check in shown
    ]
    return "\n".join(lines) + "\n"


def comparison_summary(comparison) -> str:
    """Compare's gate as a job summary: its result, then every line it printed."""
    result = comparison.lines[-1] if comparison.lines else "result: none"
    return "\n".join(
        [f"### qwz-qualify compare: {result.removeprefix('result: ')}", "", "```",
         *comparison.lines, "```", ""]
    )  # fmt: skip
