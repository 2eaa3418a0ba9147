"""Speed statistics to trust: order-balanced blocks, a bootstrap interval, a paired test.

[Note: order-balanced blocks]
A speed claim compares two arms that run one after the other on the same
machine, which drifts: clocks boost and throttle, caches and allocators warm
up, neighbours come and go. Timing all of the reference and then all of the
candidate folds that drift into the speed-up. So the measurement is split into
``blocks``; each block runs both arms, the reference first in even blocks
(``AB``) and the candidate first in odd blocks (``BA``). A drift that is
roughly linear over two neighbouring blocks then favours each arm equally
often, and the median over blocks cancels it. Inside a block each arm first
runs ``warmup_steps`` untimed steps (the switch from the other arm costs cache
and allocator state that is not the arm's own cost), then ``block_steps``
steps timed one by one; the block's figure for an arm is the median of its
step times, which ignores the occasional hiccup (a GC pause, a late rank).

The per-block speed-up is ``median(reference) / median(candidate)``, so a
value above 1 means the candidate is faster. Blocks, not steps, are the
independent units: steps inside a block share the machine's state of the
moment. Everything below therefore works on a handful of numbers (four by
default), which decides the choice of interval and test
(see ``bootstrap_median_ci`` and ``paired_p_value``).

The blocks are timed by run/timing.py; this module is pure statistics of their
step times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0

TEST_DESCRIPTION = (
    "two-sided paired t-test on the log of the per-block median step times (scipy.stats.ttest_rel)"
)

METHOD_NOTE = (
    "Speed is measured in order-balanced blocks: each block runs both arms, the reference "
    "first in even blocks (AB) and the candidate first in odd blocks (BA), so a slow drift of "
    "the machine favours neither arm. In each block every arm runs untimed warm-up steps, then "
    "timed steps, each bracketed by a device synchronisation; the block's figure for an arm is "
    "its median step time, and the block's speed-up is the reference median over the candidate "
    "median (above 1 means the candidate is faster). The reported speed-up is the median over "
    "blocks, with a seeded percentile-bootstrap confidence interval of that median; the p-value "
    "is a two-sided paired t-test on the log per-block medians (the null hypothesis: no speed "
    "difference). With few blocks the interval cannot be narrower than the spread of the "
    "blocks themselves: it is evidence about this machine and this run, not a promise for others."
)


class BlockTiming(NamedTuple):
    """The raw step times of one block: ``order`` says which arm ran first."""

    order: Literal["AB", "BA"]
    reference_times: list[float]
    """Seconds per timed step of the reference, in run order."""
    candidate_times: list[float]
    """Seconds per timed step of the candidate, in run order."""
    reference_gather_times: Sequence[float | None] = ()
    """Per timed reference step, what its step function's reading returned: the seconds of
    its weight gather ([Note: gather phase timing], run/gather_timing.py), or None."""
    candidate_gather_times: Sequence[float | None] = ()


class SpeedSummary(NamedTuple):
    speedups: list[float]
    """Per block: median reference step time / median candidate step time."""
    median_speedup: float
    ci_low: float
    ci_high: float
    ci_method: str
    """How the interval was computed, in words (method, resamples, seed, confidence)."""
    p_value: float
    test: str
    """Which test produced ``p_value``, in words."""


def require_count(name: str, value: int, minimum: int) -> None:
    """Raise unless `value` is an integer (not a bool) of at least `minimum`, naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: {value!r} is invalid: it must be an integer >= {minimum}")


def median_step_times(block: BlockTiming) -> tuple[float, float]:
    """(reference, candidate) median seconds per step of one block."""
    if not block.reference_times or not block.candidate_times:
        raise ValueError("a block needs at least one timed step of each arm")
    return float(np.median(block.reference_times)), float(np.median(block.candidate_times))


def block_speedups(blocks: Sequence[BlockTiming]) -> list[float]:
    """Per block, median(reference_times) / median(candidate_times): > 1 means the candidate is
    faster."""
    speedups = []
    for block in blocks:
        reference_s, candidate_s = median_step_times(block)
        if candidate_s <= 0.0:
            raise ValueError(f"candidate median step time {candidate_s!r} s is not positive")
        speedups.append(reference_s / candidate_s)
    return speedups


def bootstrap_median_ci(
    values: Sequence[float],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median of ``values``.

    Draw ``resamples`` samples of ``len(values)`` values with replacement (a
    ``numpy.random.Generator`` seeded with ``seed``, so the interval is
    reproducible), take each sample's median, and return the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those
    medians (linear interpolation, as ``numpy.quantile`` and
    ``scipy.stats.bootstrap(method="percentile")`` do).

    Why the percentile method and not BCa: the inputs are a few blocks (four
    by default). BCa corrects the quantile levels with a bias term and an
    acceleration estimated by the jackknife; with four values the jackknife
    medians take at most four distinct values, so the acceleration swings with
    every block and the corrected levels jump between neighbouring data sets.
    The percentile interval stays inside the range of the data and is easy to
    reason about. The price, stated plainly: its coverage is only
    approximately ``confidence``, and it is as wide as the bootstrap
    distribution of the median of ``n`` values makes it: with n = 4 at 95% it
    is exactly [min, max] of the blocks (a resample's median equals the
    smallest value with probability about 5%, more than the 2.5% tail).
    """
    sample = np.asarray(values, dtype=np.float64)
    if sample.ndim != 1 or sample.size == 0:
        raise ValueError(f"values: need a non-empty 1-D sequence, got shape {sample.shape}")
    if not np.all(np.isfinite(sample)):
        raise ValueError(f"values: {sample.tolist()} contains a non-finite value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: {confidence!r} is invalid: it must lie in (0, 1)")
    require_count("resamples", resamples, 1)
    generator = np.random.default_rng(seed)
    indices = generator.integers(0, sample.size, size=(resamples, sample.size))
    medians = np.median(sample[indices], axis=1)  # (resamples,)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return float(low), float(high)


def paired_p_value(reference_medians: Sequence[float], candidate_medians: Sequence[float]) -> float:
    """Two-sided paired t-test of "no speed difference" on the log of the per-block medians.

    The pairs are the blocks: ``log(reference_i) - log(candidate_i)`` is the
    log of block ``i``'s speed-up, and the test asks whether its mean is zero
    (``scipy.stats.ttest_rel``). Logs because step times are ratio-scale: a
    10% slowdown is the same effect on a fast and a slow block.

    Degenerate inputs, where the t statistic is undefined: fewer than two
    blocks, or block differences all equal (up to rounding) with zero mean,
    return 1.0 (no evidence of a difference); all equal with a non-zero mean
    returns 0.0 (the limit of the test as the spread vanishes).
    """
    reference = np.asarray(reference_medians, dtype=np.float64)
    candidate = np.asarray(candidate_medians, dtype=np.float64)
    if reference.shape != candidate.shape or reference.ndim != 1:
        raise ValueError(
            f"reference_medians and candidate_medians must be 1-D of one length, "
            f"got {reference.shape} and {candidate.shape}"
        )
    if np.any(reference <= 0.0) or np.any(candidate <= 0.0):
        raise ValueError("step times must be positive to take their logarithm")
    if reference.size < 2:
        return 1.0
    log_reference, log_candidate = np.log(reference), np.log(candidate)
    log_speedups = log_reference - log_candidate
    # Logs of step times carry rounding of this order; a spread below it is no spread.
    rounding = 8.0 * np.finfo(np.float64).eps * float(np.max(np.abs(log_reference)) + 1.0)
    if float(np.ptp(log_speedups)) <= rounding:
        return 1.0 if abs(float(np.mean(log_speedups))) <= rounding else 0.0
    # scipy is an optional dependency (the ``qualify`` and ``test`` extras) and costs a
    # second to import: only the test needs it, not report or compare.
    import scipy.stats

    return float(scipy.stats.ttest_rel(log_reference, log_candidate).pvalue)


def describe_ci(confidence: float, resamples: int, seed: int) -> str:
    return (
        f"percentile bootstrap of the median over blocks, {resamples} resamples, "
        f"seed {seed}, {confidence:.0%}"
    )


def summarize(
    blocks: Sequence[BlockTiming],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> SpeedSummary:
    """Per-block speed-ups, their median with a bootstrap interval, and the paired p-value."""
    if not blocks:
        raise ValueError("blocks: need at least one block to summarize")
    speedups = block_speedups(blocks)
    medians = [median_step_times(block) for block in blocks]
    ci_low, ci_high = bootstrap_median_ci(
        speedups, confidence=confidence, resamples=resamples, seed=seed
    )
    return SpeedSummary(
        speedups=speedups,
        median_speedup=float(np.median(speedups)),
        ci_low=ci_low,
        ci_high=ci_high,
        ci_method=describe_ci(confidence, resamples, seed),
        p_value=paired_p_value([ref for ref, _ in medians], [cand for _, cand in medians]),
        test=f"{TEST_DESCRIPTION}, {len(blocks)} blocks",
    )
