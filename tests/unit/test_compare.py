"""The regression gate of ``qwz/qualify/compare.py``: each rule, and the pairs it must not judge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qwz.qualify import record
from qwz.qualify.compare import Status, compare, compare_files

from .records import CANDIDATE, REFERENCE, fake_hash, make_payload, make_record

BASELINE = make_record()


def candidate_with(edit, **overrides: Any) -> record.Record:
    """A record made from the default payload after ``edit(payload)``; verdict re-derived."""
    payload = make_payload(**overrides)
    edit(payload)
    payload.pop("verdict")
    checks = [record.Check.model_validate(check) for check in payload["checks"]]
    payload["verdict"] = record.verdict_of(checks).model_dump(mode="json")
    return record.seal(payload)


def text(comparison) -> str:
    return "\n".join(comparison.lines)


def regressions(comparison) -> list[str]:
    return [line for line in comparison.lines if line.startswith("REGRESSION")]


def test_identical_records_do_not_regress():
    comparison = compare(BASELINE, make_record())
    assert comparison.status == Status.NO_REGRESSION == 0
    assert regressions(comparison) == []
    assert comparison.lines[-1] == "result: no regression"


def test_a_check_that_now_fails_is_a_regression():
    def fail_tolerance(payload):
        payload["checks"][1] |= {"passed": False, "detail": "3 of 10240 outside the bound"}

    comparison = compare(BASELINE, candidate_with(fail_tolerance))
    assert comparison.status == Status.REGRESSION == 1
    [line] = regressions(comparison)
    assert "'tolerance'" in line and "3 of 10240" in line
    assert "verdict: PASS -> FAIL" in comparison.lines


def test_a_new_failing_check_is_a_regression():
    def add_failing(payload):
        payload["checks"].append({"name": "staging-bound", "passed": False, "detail": "over"})

    comparison = compare(BASELINE, candidate_with(add_failing))
    assert comparison.status == Status.REGRESSION
    assert "staging-bound" in regressions(comparison)[0]


def test_a_check_failing_in_both_is_reported_not_a_regression():
    def fail_probe(payload):
        payload["checks"][3] |= {"passed": False, "detail": "rank 1 reports 8192"}

    baseline = candidate_with(fail_probe)
    comparison = compare(baseline, candidate_with(fail_probe))
    assert comparison.status == Status.NO_REGRESSION
    assert any("still fails" in line and "group-size-probe" in line for line in comparison.lines)
    improved = compare(baseline, BASELINE)
    assert improved.status == Status.NO_REGRESSION
    assert any("improved" in line and "group-size-probe" in line for line in improved.lines)


def change_hash(payload):
    payload["hashes"][1]["per_rank"] = [fake_hash("something else")] * 2


def test_a_changed_hash_at_the_same_head_and_environment_is_a_regression():
    comparison = compare(BASELINE, candidate_with(change_hash))
    assert comparison.status == Status.REGRESSION
    [line] = regressions(comparison)
    assert CANDIDATE in line and fake_hash(CANDIDATE)[:12] in line
    assert fake_hash("something else")[:12] in line


@pytest.mark.parametrize(
    "head",
    [
        {"sha": "0123456789abcdef0123456789abcdef01234567"},  # a new commit
        {"dirty": True},  # uncommitted changes: the SHA does not identify the code
    ],
    ids=["new-head", "dirty-head"],
)
def test_a_changed_hash_with_different_code_is_only_reported(head):
    comparison = compare(BASELINE, candidate_with(change_hash, head=head))
    assert comparison.status == Status.NO_REGRESSION
    [line] = [line for line in comparison.lines if "hash of 'candidate-g64' changed" in line]
    assert "as expected" in line


def set_speed(median: float, low: float, high: float):
    def edit(payload):
        payload["performance"][0] |= {"median_speedup": median, "ci_low": low, "ci_high": high}

    return edit


def test_a_speedup_interval_below_the_baseline_is_a_regression():
    baseline_low = BASELINE.performance[0].ci_low
    comparison = compare(BASELINE, candidate_with(set_speed(1.02, 1.01, baseline_low - 1e-4)))
    assert comparison.status == Status.REGRESSION
    [line] = regressions(comparison)
    assert "speed-up of 'candidate-g64' fell" in line
    assert "1.020x [1.010, 1.036]" in line and "baseline 1.037x [1.036, 1.039]" in line


def test_overlapping_or_better_speedup_intervals_do_not_regress():
    overlapping = compare(BASELINE, candidate_with(set_speed(1.030, 1.020, 1.0365)))
    assert overlapping.status == Status.NO_REGRESSION
    assert any("unchanged within the intervals" in line for line in overlapping.lines)
    faster = compare(BASELINE, candidate_with(set_speed(1.10, 1.09, 1.11)))
    assert faster.status == Status.NO_REGRESSION
    assert any(line.startswith("improved: speed-up") for line in faster.lines)


def grow_memory(factor: float):
    def edit(payload):
        for memory in payload["performance"][0]["memory"]:
            memory["peak_allocated_bytes"] = round(memory["peak_allocated_bytes"] * factor)

    return edit


def test_memory_growth_beyond_the_limit_is_a_regression():
    comparison = compare(BASELINE, candidate_with(grow_memory(1.20)))
    assert comparison.status == Status.REGRESSION
    [line] = regressions(comparison)
    assert "peak allocated memory" in line and "+20.0%" in line


def test_memory_growth_within_the_limit_is_not():
    comparison = compare(BASELINE, candidate_with(grow_memory(1.05)))
    assert comparison.status == Status.NO_REGRESSION
    assert any("+5.0%" in line and "within 10%" in line for line in comparison.lines)
    looser = compare(BASELINE, candidate_with(grow_memory(1.20)), memory_growth_pct=25.0)
    assert looser.status == Status.NO_REGRESSION


def test_memory_is_judged_on_the_largest_rank():
    def grow_rank_1(payload):
        payload["performance"][0]["memory"][1]["peak_allocated_bytes"] *= 2

    assert compare(BASELINE, candidate_with(grow_rank_1)).status == Status.REGRESSION


def test_several_regressions_are_all_listed_first():
    def everything(payload):
        change_hash(payload)
        grow_memory(1.5)(payload)
        set_speed(0.9, 0.89, 0.91)(payload)

    comparison = compare(BASELINE, candidate_with(everything))
    assert comparison.status == Status.REGRESSION
    assert len(regressions(comparison)) == 3
    assert comparison.lines[2:5] == regressions(comparison)
    assert comparison.lines[-1] == "result: 3 regressions"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"environment": {"world_size": 4}}, "environment.world_size: 2 -> 4"),
        ({"environment": {"torch": "2.8.0+cu128"}}, "environment.torch"),
        ({"environment": {"backend": "gloo"}}, "environment.backend"),
        ({"subject": {"name": "deepspeed"}}, "subjects differ"),
        ({"workload": {"steps": 40}}, "workload.steps: 20 -> 40"),
        ({"workload": {"seed": 7}}, "workload.seed"),
        ({"workload": {"params": {"hidden_size": 256}}}, "workload.params.hidden_size"),
    ],
)
def test_records_of_different_setups_are_not_comparable(overrides, reason):
    comparison = compare(BASELINE, make_record(**overrides))
    assert comparison.status == Status.NOT_COMPARABLE == 2
    assert any(line.startswith("NOT COMPARABLE") and reason in line for line in comparison.lines)
    assert comparison.lines[-1] == "result: not comparable"


def test_different_arms_are_not_comparable():
    def rename(payload):
        payload["arms"][1]["name"] = "candidate-g128"

    def regroup(payload):
        zero = payload["arms"][1]["config"]["zero_optimization"]
        zero["zero_quantized_weights_group_size"] = 128

    renamed = compare(BASELINE, candidate_with(rename))
    assert renamed.status == Status.NOT_COMPARABLE
    assert "arms differ" in text(renamed)
    regrouped = compare(BASELINE, candidate_with(regroup))
    assert regrouped.status == Status.NOT_COMPARABLE
    assert "zero_optimization.zero_quantized_weights_group_size: 64 -> 128" in text(regrouped)


def test_a_different_platform_string_alone_is_comparable():
    comparison = compare(BASELINE, make_record(environment={"platform": "Linux-6.9.1-x86_64"}))
    assert comparison.status == Status.NO_REGRESSION
    assert any(line.startswith("platform changed") for line in comparison.lines)


def test_a_different_schema_version_is_not_comparable():
    # A Record cannot be validated with another version; model_copy skips validation.
    future = BASELINE.model_copy(update={"schema_version": 2})
    comparison = compare(BASELINE, future)
    assert comparison.status == Status.NOT_COMPARABLE
    assert "schema versions differ: 1 -> 2" in text(comparison)


def test_memory_growth_limit_is_validated():
    with pytest.raises(ValueError, match="memory_growth_pct"):
        compare(BASELINE, BASELINE, memory_growth_pct=-1.0)


# --------------------------------------------------------------------------- #
# compare_files
# --------------------------------------------------------------------------- #


@pytest.fixture
def baseline_path(tmp_path):
    path = tmp_path / "baseline.json"
    record.save(BASELINE, path)
    return path


def test_compare_files_of_valid_records(tmp_path, baseline_path):
    candidate_path = tmp_path / "candidate.json"
    record.save(candidate_with(grow_memory(1.2)), candidate_path)
    assert compare_files(baseline_path, baseline_path).status == Status.NO_REGRESSION
    assert compare_files(baseline_path, candidate_path).status == Status.REGRESSION
    looser = compare_files(baseline_path, candidate_path, memory_growth_pct=30.0)
    assert looser.status == Status.NO_REGRESSION


def test_compare_files_with_another_schema_version(tmp_path, baseline_path):
    payload = json.loads(baseline_path.read_text())
    payload["schema_version"] = 2
    payload["digest"] = record.canonical_digest(payload)
    future_path = tmp_path / "future.json"
    future_path.write_text(json.dumps(payload))
    comparison = compare_files(baseline_path, future_path)
    assert comparison.status == Status.NOT_COMPARABLE
    assert "candidate record rejected" in text(comparison)
    assert "schema_version 2 is not supported" in text(comparison)


def test_compare_files_with_a_tampered_record(tmp_path, baseline_path):
    payload = json.loads(baseline_path.read_text())
    payload["performance"][0]["ci_low"] = 1.5  # faster on paper, digest left as it was
    tampered_path = tmp_path / "tampered.json"
    tampered_path.write_text(json.dumps(payload))
    comparison = compare_files(tampered_path, baseline_path)
    assert comparison.status == Status.NOT_COMPARABLE
    assert "baseline record rejected" in text(comparison) and "digest" in text(comparison)


def test_compare_files_with_a_missing_file(tmp_path, baseline_path):
    comparison = compare_files(baseline_path, tmp_path / "absent.json")
    assert comparison.status == Status.NOT_COMPARABLE
    assert "cannot read" in text(comparison)


def test_the_reference_arm_hash_is_judged_too():
    def change_reference(payload):
        payload["hashes"][0]["per_rank"] = [fake_hash("other reference")] * 2

    comparison = compare(BASELINE, candidate_with(change_reference))
    assert comparison.status == Status.REGRESSION
    assert REFERENCE in regressions(comparison)[0]
