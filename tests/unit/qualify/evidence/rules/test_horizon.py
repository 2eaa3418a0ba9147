"""The long horizon's learning verdict on synthetic gap series:
``qwz/qualify/evidence/rules/horizon.py`` ([Note: non-inferiority over the horizon]) and its use by
``checks.derive``.

The series imitate a 2,000-step run evaluated every 20 steps on 16 held-out batches: a
reference whose loss falls to a plateau, batches of different difficulty that every arm
shares, and per-arm wander of the size a quantization-sized perturbation causes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qwz.qualify.evidence.rules import horizon, learning
from tests.unit.records import CALIBRATION, CANDIDATE, REFERENCE, make_payload, make_record

STEPS = 2000
EVAL_STEPS = list(range(0, STEPS + 1, 20))
BATCHES = 16
PLATEAU = 0.012


def reference_series(seed: int = 0) -> dict[int, list[float]]:
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0.0, 0.002, BATCHES)  # the same batches at every evaluation
    noise = rng.normal(0, 2e-5, (len(EVAL_STEPS), BATCHES))
    return {
        step: list(0.9 * math.exp(-step / 150) + PLATEAU + difficulty + noise[index])
        for index, step in enumerate(EVAL_STEPS)
    }


def perturbed(reference, seed: int, offset=lambda step: 0.0, wander: float = 1e-4):
    """`reference` plus per-batch noise of `wander` and `offset(step)` on every batch."""
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 2 * math.pi)
    return {
        step: [
            value + offset(step) + wander * (math.sin(step / 300 + phase) + rng.normal())
            for value in values
        ]
        for step, values in reference.items()
    }


def means(series):
    return {step: float(np.mean(values)) for step, values in series.items()}


def judge(candidate, reference, calibration, steps=STEPS):
    eval_steps = [step for step in EVAL_STEPS if step <= steps]
    return horizon.judge(
        {step: candidate[step] for step in eval_steps},
        {step: reference[step] for step in eval_steps},
        None if calibration is None else {step: calibration[step] for step in eval_steps},
        means(reference),
        eval_steps,
        steps,
    )


def test_a_correct_candidate_passes_with_room_to_spare():
    reference = reference_series()
    for seed in range(10):
        calibration, candidate = perturbed(reference, 100 + seed), perturbed(reference, seed)
        judged = judge(candidate, reference, calibration)
        assert judged.status == "pass", judged.detail
        assert judged.numbers["upper"] < 0.5 * judged.numbers["margin"]
        assert judged.numbers["window"] == [1020, 2000]
        assert judged.numbers["window_evaluations"] == 50 and judged.numbers["batches"] == 16


def test_a_drift_that_starts_after_hundreds_of_steps_fails():
    """The candidate is the correct one until step 1200, then its held-out loss drifts up
    linearly (to 20% of the plateau at step 2000): the first 1,000 steps pass, the long
    horizon fails it."""
    reference = reference_series()
    calibration = perturbed(reference, 100)

    def drift(step):
        return 0.2 * PLATEAU * max(0, step - 1200) / 800

    candidate = perturbed(reference, 1, offset=drift)
    assert judge(candidate, reference, calibration, steps=1000).status == "pass"
    judged = judge(candidate, reference, calibration)
    assert judged.status == "fail", judged.detail
    assert judged.numbers["upper"] > judged.numbers["margin"]
    assert "upper bound" in judged.detail and "> margin" in judged.detail


def test_the_margin_comes_from_the_calibration_arm():
    """A candidate worse by a constant 3x the floor: inside the margin a calibration arm as
    far from the reference allows, outside the margin of a calibration arm that stayed on
    the reference (the floor alone)."""
    reference = reference_series()
    floor = horizon.MARGIN_FLOOR * PLATEAU
    candidate = perturbed(reference, 1, offset=lambda step: 3 * floor)
    far = perturbed(reference, 100, offset=lambda step: 2 * floor)
    near = perturbed(reference, 100, offset=lambda step: 0.0, wander=1e-6)

    wide = judge(candidate, reference, far)
    assert wide.status == "pass", wide.detail
    assert wide.numbers["margin"] == pytest.approx(
        horizon.MARGIN_FACTOR * wide.numbers["calibration_bound"]
    )
    assert wide.numbers["calibration_mean_gap"] == pytest.approx(2 * floor, abs=1e-4)
    narrow = judge(candidate, reference, near)
    assert narrow.status == "fail", narrow.detail
    assert narrow.numbers["margin"] == pytest.approx(
        horizon.MARGIN_FLOOR * narrow.numbers["reference_window_loss"]
    )


def test_the_bound_is_students_one_sided_upper_bound():
    scipy_stats = pytest.importorskip("scipy.stats")
    bound = horizon.bound([1.0, 2.0, 3.0, 4.0])
    half_width = scipy_stats.t.ppf(0.95, 3) * np.std([1, 2, 3, 4], ddof=1) / 2
    assert bound.mean == 2.5 and bound.batches == 4
    assert bound.upper == pytest.approx(2.5 + half_width)
    assert horizon.bound([-4.0, -3.0, -2.0, -1.0]).absolute == pytest.approx(2.5 + half_width)
    with pytest.raises(ValueError, match="at least 4"):
        horizon.bound([1.0, 2.0, 3.0])


def test_missing_losses_fail_and_degenerate_windows_are_inconclusive():
    reference = reference_series()
    calibration, candidate = perturbed(reference, 100), perturbed(reference, 1)
    candidate[1500][3] = None
    judged = judge(candidate, reference, calibration)
    assert judged.status == "fail" and "missing or non-finite" in judged.detail
    # Two evaluations in the last half of a 40-step horizon: too few to average over.
    short = judge(perturbed(reference, 1), reference, calibration, steps=40)
    assert short.status == "inconclusive" and "--eval-every" in short.detail
    few = {step: values[:3] for step, values in reference.items()}
    thin = judge(perturbed(few, 1), few, perturbed(few, 100))
    assert thin.status == "inconclusive" and "fewer than 4 batches" in thin.detail


def _long_record(candidate, reference, calibration):
    """A record of the long preset whose trajectories hold `...` batch losses."""
    payload = make_payload()
    arms = {REFERENCE: reference, CALIBRATION: calibration, CANDIDATE: candidate}
    for trajectory in payload["trajectories"]:
        series = arms[trajectory["arm"]]
        trajectory["held_out"] = [
            {"step": step, "loss": float(np.mean(values)), "batch_losses": list(values)}
            for step, values in series.items()
        ]
        trajectory["steps_planned"] = STEPS
    payload["workload"]["steps"] = STEPS
    payload["learning"].update(
        eval_steps=EVAL_STEPS, held_out_batches_per_rank=BATCHES // 2, rule="non-inferiority"
    )
    return payload


def test_the_long_rule_decides_learning_in_a_record():
    reference = reference_series()
    calibration = perturbed(reference, 100)
    correct = _long_record(perturbed(reference, 1), reference, calibration)
    late = _long_record(
        perturbed(reference, 1, offset=lambda step: 0.2 * PLATEAU * max(0, step - 1200) / 800),
        reference,
        calibration,
    )
    for payload, status in ((correct, "pass"), (late, "fail")):
        record = make_record(
            trajectories=payload["trajectories"],
            learning=payload["learning"],
            workload=payload["workload"],
        )
        check = {c.name: c for c in record.checks}[f"learning[{CANDIDATE}]"]
        assert check.status == status, check.detail
        assert "upper bound" in check.detail
        # The gap series at every evaluation after step 0 is recorded with the verdict.
        assert [step for step, _ in check.numbers["gaps"]] == EVAL_STEPS[1:]
    assert {c.name: c for c in record.checks}[f"learning[{REFERENCE}]"].status == "pass"


def test_a_record_of_the_default_rule_is_judged_as_before():
    record = make_record()
    assert record.learning.rule == "max-gap"
    check = {c.name: c for c in record.checks}[f"learning[{CANDIDATE}]"]
    assert "worst_gap" in check.numbers and check.numbers["margin"] == pytest.approx(
        learning.learning_margin(record)["margin"]
    )


def test_the_candidate_is_judged_by_its_upper_bound_not_its_mean():
    """Batch by batch the candidate is worse by amounts whose mean lies inside the floor
    margin but whose spread over the 16 batches leaves the upper bound outside it."""
    reference = reference_series()
    calibration = perturbed(reference, 100, wander=1e-6)  # the margin is the floor
    floor = horizon.MARGIN_FLOOR * float(np.mean([means(reference)[s] for s in EVAL_STEPS[51:]]))
    z = np.random.default_rng(3).normal(size=BATCHES)
    per_batch = 0.7 * floor + 1.5 * floor * (z - z.mean()) / z.std(ddof=1)
    candidate = {step: list(np.add(values, per_batch)) for step, values in reference.items()}
    judged = judge(candidate, reference, calibration)
    assert judged.numbers["mean_gap"] == pytest.approx(0.7 * floor)
    assert judged.numbers["mean_gap"] < judged.numbers["margin"] < judged.numbers["upper"]
    assert judged.status == "fail", judged.detail
