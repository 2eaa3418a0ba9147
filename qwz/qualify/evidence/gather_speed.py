"""The weight gather's speed-up, derived from the gather seconds of every timed step.

The raw numbers are per timed step ([Note: gather phase timing], qualify/run/gather_timing.py):
``Block.reference_gather_s`` and ``Block.candidate_gather_s``, None where a step's gather
was not measured. As for whole steps ([Note: order-balanced blocks], qualify/evidence/stats.py), a
block's figure for an arm is the median of its measured steps, the block's gather
speed-up is the reference's median over the candidate's, and the interval is the
percentile bootstrap of the median over blocks, given only with at least
``MIN_BLOCKS_FOR_INTERVAL`` blocks that measured both arms. Records written before the
gather was timed hold no gather seconds: every derived field is then its default, so they
load as they were written.
"""

from __future__ import annotations

import statistics
from typing import Any

from qwz.qualify.evidence import stats

NOT_MEASURED = "not measured"


def _median(values: list[float | None] | None) -> float | None:
    measured = [value for value in values or [] if value is not None]
    return statistics.median(measured) if measured else None


def block_fields(block: dict[str, Any]) -> dict[str, Any]:
    """A block's raw gather seconds and their derived medians and speed-up."""
    reference = block.get("reference_gather_s") or []
    candidate = block.get("candidate_gather_s") or []
    reference_s, candidate_s = _median(reference), _median(candidate)
    speedup = None
    if reference_s is not None and candidate_s is not None and candidate_s > 0:
        speedup = reference_s / candidate_s
    return {
        "reference_gather_s": list(reference),
        "candidate_gather_s": list(candidate),
        "reference_gather_step_s": reference_s,
        "candidate_gather_step_s": candidate_s,
        "gather_speedup": speedup,
    }


def summary(blocks: list[dict[str, Any]], min_blocks: int) -> dict[str, Any]:
    """The Performance's gather fields from its blocks (each with `block_fields`)."""
    speedups = [block["gather_speedup"] for block in blocks if block["gather_speedup"]]
    fields = {
        "gather_interval": NOT_MEASURED,
        "gather_median_speedup": None,
        "gather_ci_low": None,
        "gather_ci_high": None,
    }
    if not speedups:
        return fields
    if len(speedups) < min_blocks:
        return dict(fields, gather_interval="insufficient blocks")
    low, high = stats.bootstrap_median_ci(speedups)
    return dict(
        fields,
        gather_interval="bootstrap",
        gather_median_speedup=statistics.median(speedups),
        gather_ci_low=low,
        gather_ci_high=high,
    )
