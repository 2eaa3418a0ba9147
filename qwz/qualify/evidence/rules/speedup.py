"""``speedup[arm]``: an explicit speed requirement (``--min-speedup``), when the run was given
one: the lower end of the speed-up interval (speed.py) must reach it."""

from __future__ import annotations

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.rules.speed import MIN_BLOCKS_FOR_INTERVAL
from qwz.qualify.evidence.schema import Check


@rule("speedup", 1)
def speedup(performance, min_speedup: float) -> Check:
    """An explicit speed requirement, when the run was given one."""
    name = f"speedup[{performance.arm}]"
    if performance.interval != "bootstrap" or performance.ci_low is None:
        return check(
            name,
            "n/a",
            f"insufficient blocks: {len(performance.blocks)} < "
            f"{MIN_BLOCKS_FOR_INTERVAL}, no interval to hold to {min_speedup}",
        )
    return check(
        name,
        "pass" if performance.ci_low >= min_speedup else "fail",
        f"median {performance.median_speedup:.4f}x, 95% interval "
        f"[{performance.ci_low:.4f}, {performance.ci_high:.4f}]; required lower "
        f"end >= {min_speedup}",
        median=performance.median_speedup,
        ci_low=performance.ci_low,
    )
