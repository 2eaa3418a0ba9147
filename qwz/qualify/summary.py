"""The one-line verdict banner, and the short markdown of a GitHub job summary.

[Note: verdict banner]
Correctness and speed are separate claims and the banner says both: the verdict of the
checks, then each candidate's step speed-up with its interval, or why it was not measured
("PASS; speed 1.037x [1.036, 1.039]", "INCONCLUSIVE (in-effect[q64]); speed: not measured
(3 blocks)"), and the weight gather's own speed-up where it was timed ([Note: gather phase
timing], qualify/gather_timing.py). With several candidates each is named. A speed-up
never turns a FAIL into anything else, nor does its absence turn a PASS into a FAIL: a
speed requirement is a check of its own (``--min-speedup``).
"""

from __future__ import annotations

from qwz.qualify.record import Performance, Record


def _interval(median: float, low: float, high: float) -> str:
    return f"{median:.3f}x [{low:.3f}, {high:.3f}]"


def speed_text(performance: Performance) -> str:
    """The step speed-up of one candidate with its interval, and its gather's."""
    if performance.median_speedup is None:
        text = f"not measured ({len(performance.blocks)} blocks)"
    else:
        text = _interval(performance.median_speedup, performance.ci_low, performance.ci_high)
    if performance.gather_median_speedup is not None:
        gather = _interval(
            performance.gather_median_speedup, performance.gather_ci_low,
            performance.gather_ci_high,
        )  # fmt: skip
        text += f"; gather {gather}"
    return text


def banner(record: Record) -> str:
    """[Note: verdict banner]."""
    verdict = record.verdict
    status = verdict.status
    if verdict.failed:
        status += f" ({', '.join(verdict.failed)})"
    elif verdict.inconclusive:
        status += f" ({', '.join(verdict.inconclusive)})"
    performances = record.performance
    if not performances:
        return f"{status}; speed: not measured (no blocks)"
    if len(performances) == 1:
        only = performances[0]
        return f"{status}; speed{':' if only.median_speedup is None else ''} {speed_text(only)}"
    parts = [f"`{item.arm}` {speed_text(item)}" for item in performances]
    return f"{status}; speed {'; '.join(parts)}"


_MARK = {"pass": "pass", "fail": "**FAIL**", "n/a": "n/a", "inconclusive": "*inconclusive*"}


def record_summary(record: Record) -> str:
    """A record as a job summary: the title, the banner, the checks that did not pass (all
    of them when every one did) and each candidate's speed."""
    from qwz.qualify.report import title

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
