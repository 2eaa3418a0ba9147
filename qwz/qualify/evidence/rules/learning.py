"""``learning[arm]``: the reference learned, and each candidate's held-out loss stays within
the margin of it ([Note: learning margin]); under the long preset, by [Note: non-inferiority
over the horizon] (horizon.py).

[Note: learning margin]
Quantized weights change the forward pass, so a correct candidate's held-out
loss differs from the reference's; the question is by how much a *correct*
one may. The ``calibration`` arm answers it on the same run: the unquantized
reference, with uniform noise in [-scale/2, scale/2] (each group's own scale,
at the largest candidate group size) added to the working weights after every
step -- the size and shape of the quantization error, but random, while the
master stays exact, as in a candidate. Its held-out losses differ from the
reference's by ``noise_gap`` (the largest absolute difference over the
evaluation steps after step 0): how far quantization-sized perturbations move
this workload's held-out loss. A candidate passes when, at every evaluation
step after step 0::

    held_out[candidate] - held_out[reference]
        <= margin = max(MARGIN_FACTOR * noise_gap, MARGIN_FLOOR * reference_drop)

``reference_drop`` is how much the reference's held-out loss fell from step 0
to the last evaluation. The factor allows for the noise being one draw; the
floor (a small share of what the reference learned) keeps a lucky, tiny
``noise_gap`` from failing a correct candidate. A broken candidate (no update,
ascent, a lost shard) does not learn, or un-learns: its gap is a large share
of ``reference_drop``. Under the long preset (``Learning.rule`` "non-inferiority") the
candidates are judged by [Note: non-inferiority over the horizon] (horizon.py) instead;
the reference's own check is the same. If the reference's held-out loss did not fall by at
least ``MIN_REFERENCE_DROP`` of its start, the run cannot tell learning from
not learning: ``learning[reference]`` is inconclusive, and so is the verdict.
"""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence.rules import check, horizon, rule
from qwz.qualify.evidence.schema import Check, Record

MIN_REFERENCE_DROP = 0.02
"""The reference's held-out loss must fall by this fraction of its start to be a baseline."""
MARGIN_FACTOR = 3.0
MARGIN_FLOOR = 0.01
"""Share of the reference's held-out improvement a correct candidate may always lose."""


def _held_out(record: Record) -> dict[str, dict[int, float | None]]:
    return {t.arm: {h.step: h.loss for h in t.held_out} for t in record.trajectories}


def learning_margin(record: Record) -> dict[str, Any]:
    """The numbers of [Note: learning margin] for this record (floats may be None)."""
    held_out = _held_out(record)
    reference = next((arm.name for arm in record.arms if arm.role == "reference"), None)
    ref = held_out.get(reference or "", {})
    steps = [step for step in record.learning.eval_steps if step > 0]
    start, last = ref.get(0), ref.get(max(steps)) if steps else None
    drop = None if start is None or last is None else start - last
    calibration = held_out.get(record.learning.calibration_arm or "", {})
    gaps = [
        abs(calibration[step] - ref[step])
        for step in steps
        if calibration.get(step) is not None and ref.get(step) is not None
    ]
    noise_gap = max(gaps) if len(gaps) == len(steps) and steps else None
    margin = None
    if drop is not None and drop > 0:
        margin = MARGIN_FLOOR * drop
        if noise_gap is not None:
            margin = max(margin, MARGIN_FACTOR * noise_gap)
    return {
        "reference_start": start,
        "reference_last": last,
        "reference_drop": drop,
        "noise_gap": noise_gap,
        "margin": margin,
        "margin_factor": MARGIN_FACTOR,
        "margin_floor": MARGIN_FLOOR,
        "min_reference_drop": MIN_REFERENCE_DROP,
    }


@rule("learning", 1)
def learning(record: Record, reference: str | None, candidates) -> list[Check]:
    numbers = learning_margin(record)
    reference_check = _reference_learning(reference, numbers)
    learned = reference_check.status == "pass"
    held_out = _held_out(record)
    steps = [step for step in record.learning.eval_steps if step > 0]
    # A run that crashed or never started an arm left it no held-out losses: finite says why.
    ended = {t.arm: t.failure.kind for t in record.trajectories if t.failure is not None}
    checks = [reference_check]
    for arm in candidates:
        name = f"learning[{arm.name}]"
        if ended.get(arm.name) in ("crash", "not-run"):
            checks.append(check(name, "n/a", f"the arm ended: {ended[arm.name]}; see finite"))
        elif not learned or numbers["margin"] is None:
            undecided = "inconclusive" if numbers["reference_drop"] is not None else "n/a"
            checks.append(check(name, undecided, "see the reference"))
        elif record.learning.rule == "non-inferiority":
            checks.append(_horizon(record, arm.name, reference))
        else:
            ours, theirs = held_out.get(arm.name, {}), held_out[reference]
            checks.append(_max_gap(name, ours, theirs, steps, numbers))
    return checks


def _reference_learning(reference: str | None, numbers: dict[str, Any]) -> Check:
    """``learning[reference]``: its held-out loss fell enough to be a baseline."""
    name = f"learning[{reference}]"
    start, drop = numbers["reference_start"], numbers["reference_drop"]
    if drop is None or start is None:
        return check(name, "n/a", "the reference has no held-out losses to compare")
    if drop >= MIN_REFERENCE_DROP * abs(start):
        return check(
            name,
            "pass",
            f"held-out loss fell {start:.4f} -> {numbers['reference_last']:.4f} "
            f"(>= {MIN_REFERENCE_DROP:.0%} of its start)",
            **numbers,
        )
    return check(
        name,
        "inconclusive",
        f"the reference did not learn: held-out loss {start:.4f} -> "
        f"{numbers['reference_last']:.4f}, less than {MIN_REFERENCE_DROP:.0%} of its "
        "start; learning cannot be judged on this run",
        **numbers,
    )


def _max_gap(
    name: str,
    ours: dict[int, float | None],
    theirs: dict[int, float | None],
    steps: list[int],
    numbers: dict[str, Any],
) -> Check:
    """[Note: learning margin]: a candidate's worst held-out gap to the reference."""
    if any(ours.get(step) is None for step in steps):
        return check(name, "fail", "held-out loss missing or non-finite at an evaluation step")
    margin, drop = numbers["margin"], numbers["reference_drop"]
    gaps = {step: ours[step] - theirs[step] for step in steps}
    worst_step = max(gaps, key=lambda step: gaps[step])
    how = (
        f"max({MARGIN_FACTOR:g} x calibration gap {numbers['noise_gap']:.4g}, "
        f"{MARGIN_FLOOR:.0%} of the reference's drop {drop:.4g})"
        if numbers["noise_gap"] is not None
        else f"{MARGIN_FLOOR:.0%} of the reference's drop {drop:.4g} (no calibration arm)"
    )
    return check(
        name,
        "pass" if gaps[worst_step] <= margin else "fail",
        f"held-out loss minus the reference's: worst {gaps[worst_step]:+.4g} at step "
        f"{worst_step} (last {gaps[max(steps)]:+.4g}); margin {margin:.4g} = {how}",
        worst_gap=gaps[worst_step],
        worst_step=worst_step,
        margin=margin,
    )


def _horizon(record: Record, arm: str, reference: str) -> Check:
    """[Note: non-inferiority over the horizon] (qualify/evidence/rules/horizon.py) for one
    candidate, with its gap series at every evaluation."""
    batches = {t.arm: {h.step: h.batch_losses for h in t.held_out} for t in record.trajectories}
    means = _held_out(record)
    calibration = record.learning.calibration_arm
    judged = horizon.judge(
        batches.get(arm, {}),
        batches[reference],
        batches.get(calibration) if calibration else None,
        means[reference],
        record.learning.eval_steps,
        record.workload.steps,
    )
    series = horizon.gap_series(means.get(arm, {}), means[reference])
    return check(f"learning[{arm}]", judged.status, judged.detail, **judged.numbers, gaps=series)
