"""The one-line verdict banner of a record: correctness and speed apart.

[Note: verdict banner]
Correctness and speed are separate claims and the banner says both: the verdict of the
checks, then each candidate's step speed-up with its interval, or why it was not measured
("PASS; speed 1.037x [1.036, 1.039]", "INCONCLUSIVE (in-effect[q64]); speed: not measured
(3 blocks)"), and the weight gather's own speed-up where it was timed ([Note: gather phase
timing], qualify/run/gather_timing.py). With several candidates each is named. A speed-up
never turns a FAIL into anything else, nor does its absence turn a PASS into a FAIL: a
speed requirement is a check of its own (``--min-speedup``).
"""

from __future__ import annotations

from qwz.qualify.evidence.schema import Performance, Record


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
