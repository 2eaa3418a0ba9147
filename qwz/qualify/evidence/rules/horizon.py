"""The long horizon's learning verdict: a non-inferiority bound on the held-out gap.

[Note: non-inferiority over the horizon]
The 20-step rule ([Note: learning margin], learning.py) asks whether the worst gap at any
evaluation stays within a margin; early in training the held-out loss falls fast, so
the calibration arm's early gaps are large and so is the margin, and a bug whose harm
builds up slowly stays inside it. Over a long horizon (the ``long`` preset,
qualify/base/presets.py) the question becomes: is the candidate, once trained, worse than the
reference by more than quantization may make it? Stated as a test of non-inferiority::

    H0: gap > margin        H1: gap <= margin     (the candidate passes only on H1)

``gap`` is the expected held-out loss of the candidate minus the reference's, averaged
over the *window*: the evaluation steps in the last ``WINDOW_SHARE`` of the horizon
(``step > steps * (1 - WINDOW_SHARE)``). Early, fast-moving evaluations are left out,
and a drift that only appears after hundreds of steps fills the window.

The paired units are the held-out batches. Every evaluation scores the same ``B``
batches (``held_out_batches`` per rank, on every rank; each drawn from its own seed, so
they are independent draws of the data); batch ``j`` gives one paired difference,
``d_j = mean over the window of (candidate_j(t) - reference_j(t))``. The ``d_j`` are
independent and identically distributed however strongly the gap at neighbouring
evaluations is correlated (they are), which a bound over the evaluations themselves
would have to model. The candidate's one-sided upper confidence bound is::

    upper = mean(d) + t(CONFIDENCE, B - 1) * sd(d) / sqrt(B)       (Student's t)

The margin comes from the calibration arm over the same window: the reference with
quantization-sized noise after every step (run/calibration_noise.py), a candidate whose only
difference from the reference is the size and shape of the quantization error. Its
paired differences ``c_j`` bound how far such a perturbation moves the held-out loss,
in either direction: ``calibration = |mean(c)| + t(CONFIDENCE, B - 1) * sd(c) / sqrt(B)``,
and::

    margin = max(MARGIN_FACTOR * calibration, MARGIN_FLOOR * reference_window_loss)

where ``reference_window_loss`` is the reference's mean held-out loss over the window.
The factor allows for the calibration arm being one trajectory (the correct candidate
is another, with its own chaotic departure from the reference); the floor, a small share
of the loss level itself, keeps a calibration arm that happened to land on the
reference from failing a correct candidate. Both constants were fixed on a tuning seed
that the power table (benchmarks/power.py) does not use, before its seeds were judged.
The candidate passes when ``upper <= margin``. What it cannot see: a bug whose whole cost
is smaller than a quantization's (the power table in the README measures how small).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

WINDOW_SHARE = 0.5
"""The window: evaluations in the last half of the horizon."""
MIN_WINDOW_EVALUATIONS = 3
MIN_BATCHES = 4
"""Fewer paired held-out batches give no usable spread (t with < 3 degrees of freedom)."""
CONFIDENCE = 0.95
"""One-sided confidence of each bound."""
MARGIN_FACTOR = 3.0
MARGIN_FLOOR = 0.005
"""Share of the reference's held-out loss over the window a candidate may always lose."""

BatchLosses = Mapping[int, Sequence[float | None]]
"""Per evaluation step, every held-out batch's loss (HeldOut.batch_losses)."""


class Bound(NamedTuple):
    """Statistics of the paired differences of one arm against the reference."""

    mean: float
    sd: float
    batches: int
    upper: float
    """One-sided upper confidence bound of the mean."""
    absolute: float
    """One-sided upper confidence bound of the mean's absolute value."""


class Judgement(NamedTuple):
    status: str
    detail: str
    numbers: dict[str, Any]


def window(eval_steps: Sequence[int], steps: int) -> list[int]:
    """The evaluation steps the bound averages over ([Note: non-inferiority over the
    horizon])."""
    start = steps * (1.0 - WINDOW_SHARE)
    return [step for step in eval_steps if step > start]


def t_quantile(confidence: float, degrees: int) -> float:
    """Student's t quantile (scipy: an optional dependency, the ``qualify`` extra)."""
    import scipy.stats

    return float(scipy.stats.t.ppf(confidence, degrees))


def paired_differences(arm: BatchLosses, reference: BatchLosses, steps: Sequence[int]):
    """Per held-out batch, the arm's loss minus the reference's averaged over `steps`;
    None when a loss is missing or non-finite, or the batch counts differ."""
    batches = {len(arm.get(step, ())) for step in steps} | {
        len(reference.get(step, ())) for step in steps
    }
    if len(batches) != 1 or batches == {0}:
        return None
    count = batches.pop()
    differences = []
    for batch in range(count):
        values = [(arm[step][batch], reference[step][batch]) for step in steps]
        if any(a is None or r is None or not math.isfinite(a - r) for a, r in values):
            return None
        differences.append(statistics.fmean(a - r for a, r in values))
    return differences


def bound(differences: Sequence[float]) -> Bound:
    """[Note: non-inferiority over the horizon]: the mean paired difference and its
    one-sided upper bounds (of the mean, and of its absolute value)."""
    batches = len(differences)
    if batches < MIN_BATCHES:
        raise ValueError(f"differences: {batches} batches, need at least {MIN_BATCHES}")
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    half_width = t_quantile(CONFIDENCE, batches - 1) * sd / math.sqrt(batches)
    return Bound(mean, sd, batches, mean + half_width, abs(mean) + half_width)


def gap_series(arm: Mapping[int, float | None], reference: Mapping[int, float | None]):
    """``[step, arm - reference]`` at every evaluation after step 0 (None where missing)."""
    return [
        [step, None if arm.get(step) is None or value is None else arm[step] - value]
        for step, value in sorted(reference.items())
        if step > 0
    ]


def margin(calibration: Bound | None, reference_window_loss: float) -> float:
    """``max(MARGIN_FACTOR * calibration, MARGIN_FLOOR * reference_window_loss)``; the floor
    alone without a calibration arm."""
    floor = MARGIN_FLOOR * abs(reference_window_loss)
    return floor if calibration is None else max(MARGIN_FACTOR * calibration.absolute, floor)


def _untestable(
    reference: BatchLosses, reference_means: Mapping[int, float | None], steps_in_window
) -> str | None:
    """Why the reference's own losses over the window allow no test (None: they do)."""
    if len(steps_in_window) < MIN_WINDOW_EVALUATIONS:
        return (
            f"{len(steps_in_window)} evaluations in the last {WINDOW_SHARE:.0%} of the "
            f"horizon, fewer than {MIN_WINDOW_EVALUATIONS}: evaluate more often (--eval-every)"
        )
    counts = {len(reference.get(step, ())) for step in steps_in_window}
    means = [reference_means.get(step) for step in steps_in_window]
    if counts != {max(counts)} or max(counts) < MIN_BATCHES or None in means:
        return (
            f"the reference's held-out batch losses over the window are missing or fewer than "
            f"{MIN_BATCHES} batches: nothing to pair with"
        )
    return None


def judge(
    candidate: BatchLosses,
    reference: BatchLosses,
    calibration: BatchLosses | None,
    reference_means: Mapping[int, float | None],
    eval_steps: Sequence[int],
    steps: int,
) -> Judgement:
    """[Note: non-inferiority over the horizon] for one candidate; ``inconclusive`` where
    the reference's own losses do not allow the test."""
    steps_in_window = window(eval_steps, steps)
    numbers: dict[str, Any] = {
        "window": [steps_in_window[0], steps_in_window[-1]] if steps_in_window else None,
        "window_evaluations": len(steps_in_window),
        "confidence": CONFIDENCE,
        "margin_factor": MARGIN_FACTOR,
        "margin_floor": MARGIN_FLOOR,
    }
    untestable = _untestable(reference, reference_means, steps_in_window)
    if untestable is not None:
        return Judgement("inconclusive", untestable, numbers)
    differences = paired_differences(candidate, reference, steps_in_window)
    if differences is None:
        return Judgement(
            "fail", "a held-out batch loss in the window is missing or non-finite", numbers
        )
    level = statistics.fmean(reference_means[step] for step in steps_in_window)
    cal_differences = (
        None if calibration is None else paired_differences(calibration, reference, steps_in_window)
    )
    cal = None if cal_differences is None else bound(cal_differences)
    allowed = margin(cal, level)
    ours = bound(differences)
    numbers.update(
        mean_gap=ours.mean,
        sd_gap=ours.sd,
        batches=ours.batches,
        upper=ours.upper,
        margin=allowed,
        reference_window_loss=level,
        calibration_mean_gap=None if cal is None else cal.mean,
        calibration_bound=None if cal is None else cal.absolute,
    )
    how = (
        f"max({MARGIN_FACTOR:g} x calibration bound {cal.absolute:.4g}, "
        f"{MARGIN_FLOOR:.1%} of the reference's window loss {level:.4g})"
        if cal is not None
        else f"{MARGIN_FLOOR:.1%} of the reference's window loss {level:.4g} (no calibration arm)"
    )
    status = "pass" if ours.upper <= allowed else "fail"
    return Judgement(
        status,
        f"held-out loss minus the reference's over steps {steps_in_window[0]}-"
        f"{steps_in_window[-1]} ({len(steps_in_window)} evaluations, {ours.batches} paired "
        f"batches): mean {ours.mean:+.4g}, {CONFIDENCE:.0%} upper bound {ours.upper:+.4g} "
        f"{'<=' if status == 'pass' else '>'} margin {allowed:.4g} = {how}",
        numbers,
    )
