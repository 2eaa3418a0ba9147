"""The judge's fp16 rules on synthetic observations ([Note: overflow pattern],
qwz/qualify/evidence/rules/overflow_pattern.py): the scale sequence against DeepSpeed's own loss
scaler, and the checks an fp16 record derives (finite, update, step1-exact,
overflow-pattern) when its skips and scales are right and when each is broken."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from qwz.config import LossScaleConfig
from qwz.qualify.evidence import seal
from qwz.qualify.evidence.rules import overflow_pattern as loss_scaling
from tests.loss_scale_reference import deepspeed_scaler
from tests.unit import records
from tests.unit.records import CALIBRATION, CANDIDATE, REFERENCE, STEPS

SECTION = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 20,
    "loss_scale_window": 4,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
OVERFLOWED = [step in (1, 2, 9, 10) for step in range(1, STEPS + 1)]
SCALES = [2.0**power for power in [20, 20, 19, 19, 19, 19, 19, 20, 20, 20] + [19] * 5]
SCALES += [2.0**20] * 4 + [2.0**21]
"""By hand from the rules (window 4, hysteresis 2): step 1 overflows and spends the
hysteresis, step 2 overflows and halves; after clean step 7 (4 clean steps before it, 3-6)
the scale doubles and the hysteresis refills; steps 9 and 10 overflow again (spend,
halve); it doubles after step 15 (11-14 clean before it) and after step 19 (11-18)."""


def test_the_hand_derived_sequence():
    assert len(SCALES) == STEPS
    assert loss_scaling.expected_scales(SECTION, OVERFLOWED) == SCALES
    # Hysteresis 1 halves at every overflow; the floor holds the scale at min_loss_scale.
    assert loss_scaling.expected_scales(
        SECTION | {"hysteresis": 1, "initial_scale_power": 1, "min_loss_scale": 1},
        [True, False],
    ) == [2.0, 1.0]
    # An overflow at the minimum ends the sequence: no scale is allowed after it.
    assert loss_scaling.expected_scales(
        SECTION | {"hysteresis": 1, "initial_scale_power": 0}, [True, False]
    ) == [1.0]


@given(
    overflowed=st.lists(st.booleans(), max_size=40),
    power=st.integers(2, 24),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    minimum=st.sampled_from([1, 4, 64]),
)
def test_the_rules_are_deepspeeds(overflowed, power, window, hysteresis, consecutive, minimum):
    """The judge's own statement of the rules gives DeepSpeed's DynamicLossScaler's scales
    for any overflow sequence (up to an overflow at the minimum, where DeepSpeed raises)."""
    section = {
        "initial_scale_power": power,
        "loss_scale_window": window,
        "hysteresis": hysteresis,
        "consecutive_hysteresis": consecutive,
        "min_loss_scale": minimum,
    }
    config = LossScaleConfig(
        initial_scale_power=power,
        window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=minimum,
    )
    theirs = deepspeed_scaler(config)
    scales = []
    for overflow in overflowed:
        scales.append(float(theirs.cur_scale))
        try:
            theirs.update_scale(overflow)
        except Exception:  # DeepSpeed: "Current loss scale already at minimum"
            break
    assert loss_scaling.expected_scales(section, overflowed) == scales


def test_a_fixed_scale_never_moves():
    fixed = {"loss_scale": 128}
    assert loss_scaling.expected_scales(fixed, [True, False, True]) == [128.0] * 3


# ------------------------------------------------------------------- fp16 records


def _fp16_payload(**changes):
    """A passing two-rank fp16 record: every arm overflows at OVERFLOWED, scales by SCALES,
    skips the overflowed steps on both ranks (null norms there) and first steps at 3."""
    payload = records.make_payload()
    for arm in payload["arms"]:
        arm["dtype"] = "fp16"
        arm["config"] = dict(arm["config"], bf16={"enabled": False}, fp16=dict(SECTION))
    skipped = [[step, rank] for step in (1, 2, 9, 10) for rank in (0, 1)]
    for updates in payload["updates"]:
        updates["skipped_steps"] = copy.deepcopy(skipped)
    for trajectory in payload["trajectories"]:
        trajectory["grad_norms"] = [
            None if flag else norm
            for flag, norm in zip(OVERFLOWED, trajectory["grad_norms"], strict=True)
        ]
    for item in payload["step_one"]:
        item["step"] = 3
    payload["loss_scaling"] = [
        {"arm": name, "scales": [list(SCALES), list(SCALES)], "overflowed": list(OVERFLOWED)}
        for name in (REFERENCE, CALIBRATION, CANDIDATE)
    ]
    for key, value in changes.items():
        payload[key] = value
    return payload


def _checks(payload):
    record = seal.seal(payload)
    return record, {check.name: check for check in record.checks}


def _trace(payload, arm):
    return next(item for item in payload["loss_scaling"] if item["arm"] == arm)


def test_a_correct_fp16_record_passes_with_its_skips():
    record, checks = _checks(_fp16_payload())
    assert record.verdict.status == "PASS", record.verdict
    assert checks[f"finite[{CANDIDATE}]"].numbers["overflow_skipped"] == 4
    assert "4 overflowed steps, which every rank skipped" in checks[f"update[{CANDIDATE}]"].detail
    pattern = checks[f"overflow-pattern[{CANDIDATE}]"]
    assert pattern.status == "pass" and "the same steps as the reference" in pattern.detail
    assert "first optimizer step (3)" in checks[f"step1-exact[{CANDIDATE}]"].detail


def test_a_non_finite_norm_on_a_taken_step_fails_finite():
    payload = _fp16_payload()
    trajectory = next(t for t in payload["trajectories"] if t["arm"] == CANDIDATE)
    trajectory["grad_norms"][4] = None  # step 5: no overflow, every rank stepped
    _, checks = _checks(payload)
    assert checks[f"finite[{CANDIDATE}]"].status == "fail"


def test_a_null_norm_on_a_step_only_one_rank_skipped_fails_finite_and_update():
    payload = _fp16_payload()
    updates = next(u for u in payload["updates"] if u["arm"] == CANDIDATE)
    updates["skipped_steps"].remove([9, 1])  # rank 1 stepped on an overflowed step
    _, checks = _checks(payload)
    assert checks[f"finite[{CANDIDATE}]"].status == "fail"
    update = checks[f"update[{CANDIDATE}]"]
    assert update.status == "fail"
    assert "rank 1 stepped at step 9, though a rank's fp16 gradient overflowed" in update.detail


def test_a_skip_without_overflow_fails_update():
    payload = _fp16_payload()
    updates = next(u for u in payload["updates"] if u["arm"] == CANDIDATE)
    updates["skipped_steps"] += [[5, 0], [5, 1]]
    _, checks = _checks(payload)
    update = checks[f"update[{CANDIDATE}]"]
    assert update.status == "fail"
    assert "rank 0 did not step at step 5, though no rank's gradient overflowed" in update.detail


def test_a_scale_that_starts_elsewhere_fails_overflow_pattern():
    payload = _fp16_payload()
    _trace(payload, CANDIDATE)["scales"] = [[s / 16 for s in SCALES]] * 2
    _, checks = _checks(payload)
    pattern = checks[f"overflow-pattern[{CANDIDATE}]"]
    assert pattern.status == "fail"
    assert "step 1, rank 0: the loss was scaled by 65536" in pattern.detail
    assert checks[f"overflow-pattern[{REFERENCE}]"].status == "pass"


def test_ranks_that_disagree_on_the_scale_fail_overflow_pattern():
    payload = _fp16_payload()
    _trace(payload, CANDIDATE)["scales"][1][12] = SCALES[12] * 2
    _, checks = _checks(payload)
    assert "step 13, rank 1" in checks[f"overflow-pattern[{CANDIDATE}]"].detail


def test_an_overflow_before_the_first_gather_that_the_reference_lacks_fails():
    """Until the first optimizer step both arms hold the same weights: the candidate's
    pattern must be the reference's there (here it overflows at step 3 as well)."""
    payload = _fp16_payload()
    flags = list(OVERFLOWED)
    flags[2] = True
    trace = _trace(payload, CANDIDATE)
    trace["overflowed"] = flags
    trace["scales"] = [loss_scaling.expected_scales(SECTION, flags)] * 2
    skipped = [[3, 0], [3, 1]]
    next(u for u in payload["updates"] if u["arm"] == CANDIDATE)["skipped_steps"] += skipped
    next(t for t in payload["trajectories"] if t["arm"] == CANDIDATE)["grad_norms"][2] = None
    next(i for i in payload["step_one"] if i["arm"] == CANDIDATE)["step"] = 4
    _, checks = _checks(payload)
    pattern = checks[f"overflow-pattern[{CANDIDATE}]"]
    assert pattern.status == "fail" and "before any gather" in pattern.detail
    assert checks[f"step1-exact[{CANDIDATE}]"].status == "fail"  # first steps 4 vs 3


def test_a_later_overflow_the_reference_lacks_is_reported_not_failed():
    """After the first gather the candidate's gradients differ: a different skip that its
    own overflows justify is context (in the detail and the numbers), not a failure."""
    payload = _fp16_payload()
    flags = list(OVERFLOWED)
    flags[14] = True  # step 15
    trace = _trace(payload, CANDIDATE)
    trace["overflowed"] = flags
    trace["scales"] = [loss_scaling.expected_scales(SECTION, flags)] * 2
    next(u for u in payload["updates"] if u["arm"] == CANDIDATE)["skipped_steps"] += [
        [15, 0],
        [15, 1],
    ]
    next(t for t in payload["trajectories"] if t["arm"] == CANDIDATE)["grad_norms"][14] = None
    record, checks = _checks(payload)
    pattern = checks[f"overflow-pattern[{CANDIDATE}]"]
    assert pattern.status == "pass"
    assert "differs from the reference at step(s) 15 after the first gather" in pattern.detail
    assert pattern.numbers["differs_from_reference"] == [15]
    assert record.verdict.status == "PASS"


def test_a_bf16_record_has_no_overflow_pattern():
    record = records.make_record()
    assert not [check for check in record.checks if check.name.startswith("overflow-pattern")]


def test_the_fp16_sections_survive_a_round_trip():
    payload = _fp16_payload()
    record = seal.seal(copy.deepcopy(payload))
    again = seal.seal(record.model_dump(mode="json"))
    assert again.digest == record.digest
