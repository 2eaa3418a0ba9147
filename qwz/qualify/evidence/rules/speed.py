"""``speed``: the speed summaries derived from a record's block times (the interval, the
bootstrap: stats.py; the gather's own phase: gather_speed.py). Not a check: its rule version
says how the numbers that ``speedup`` and the report read were derived."""

from __future__ import annotations

import math
import statistics
from typing import Any

from qwz.qualify.evidence import gather_speed, stats
from qwz.qualify.evidence.rules import SPEED, rule

MIN_BLOCKS_FOR_INTERVAL = 4
"""Fewer blocks give no interval: a percentile bootstrap of the median of n < 4 values can
only return the sample's own extremes, a width that says nothing about noise."""


@rule(SPEED, 1)
def summarize_blocks(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The derived speed fields of a Performance from its raw block times."""
    timings = [
        stats.BlockTiming(block["order"], block["reference_times_s"], block["candidate_times_s"])
        for block in blocks
    ]
    derived_blocks = []
    for index, (block, timing) in enumerate(zip(blocks, timings, strict=True)):
        reference_s = statistics.median(timing.reference_times)
        candidate_s = statistics.median(timing.candidate_times)
        derived_blocks.append(
            {
                "index": index,
                "order": block["order"],
                "reference_times_s": list(timing.reference_times),
                "candidate_times_s": list(timing.candidate_times),
                "reference_step_s": reference_s,
                "candidate_step_s": candidate_s,
                "speedup": reference_s / candidate_s if candidate_s > 0 else math.inf,
                **gather_speed.block_fields(block),
            }
        )
    gather = gather_speed.summary(derived_blocks, MIN_BLOCKS_FOR_INTERVAL)
    if len(timings) < MIN_BLOCKS_FOR_INTERVAL:
        return {
            "blocks": derived_blocks,
            "interval": "insufficient blocks",
            "median_speedup": None,
            "ci_low": None,
            "ci_high": None,
            "ci_method": f"none: {len(timings)} blocks < {MIN_BLOCKS_FOR_INTERVAL}",
            "p_value": None,
            "test": "none: too few blocks",
            **gather,
        }
    summary = stats.summarize(timings)
    return {
        "blocks": derived_blocks,
        "interval": "bootstrap",
        "median_speedup": summary.median_speedup,
        "ci_low": summary.ci_low,
        "ci_high": summary.ci_high,
        "ci_method": summary.ci_method,
        "p_value": summary.p_value,
        "test": summary.test,
        **gather,
    }
