"""The regression gate of ``qwz/qualify/review/compare.py``: each rule, and the pairs it must
not judge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qwz.qualify.evidence import record, schema, seal
from qwz.qualify.review.compare import Status, compare, compare_files
from tests.unit.records import CANDIDATE, REFERENCE, fake_hash, make_payload, make_record

BASELINE = make_record()


def candidate_with(edit, **overrides: Any) -> schema.Record:
    """A record sealed from the default observations after ``edit(payload)``: its checks and
    verdict are derived from the edited observations."""
    payload = make_payload(**overrides)
    edit(payload)
    return seal.seal(payload)


def text(comparison) -> str:
    return "\n".join(comparison.lines)


def regressions(comparison) -> list[str]:
    return [line for line in comparison.lines if line.startswith("REGRESSION")]


def test_identical_records_do_not_regress():
    comparison = compare(BASELINE, make_record())
    assert comparison.status == Status.NO_REGRESSION == 0
    assert regressions(comparison) == []
    assert comparison.lines[-1] == "result: no regression"


def fail_updates(payload):
    payload["updates"][2]["violations"] = 3


def test_a_check_that_now_fails_is_a_regression():
    comparison = compare(BASELINE, candidate_with(fail_updates))
    assert comparison.status == Status.REGRESSION == 1
    [line] = regressions(comparison)
    assert "'update[candidate-g64]' was pass in the baseline and is fail now" in line
    assert "verdict: PASS -> FAIL" in comparison.lines


def test_a_check_that_turns_inconclusive_is_a_regression():
    def stop_learning(payload):
        for trajectory in payload["trajectories"]:
            for point in trajectory["held_out"]:
                point["loss"] = 7.6728

    comparison = compare(BASELINE, candidate_with(stop_learning))
    assert comparison.status == Status.REGRESSION
    assert any("is inconclusive now" in line for line in regressions(comparison))
    assert "verdict: PASS -> INCONCLUSIVE" in comparison.lines


def test_a_new_failing_check_is_a_regression():
    comparison = compare(BASELINE, candidate_with(lambda p: None, plan={"min_speedup": 1.5}))
    assert comparison.status == Status.REGRESSION
    assert "speedup[candidate-g64]" in regressions(comparison)[0]
    assert "(new, not in the baseline)" in regressions(comparison)[0]


def test_a_check_failing_in_both_is_reported_not_a_regression():
    def fail_probe(payload):
        payload["probes"][0]["reported_group_sizes"] = [64, 8192]

    baseline = candidate_with(fail_probe)
    comparison = compare(baseline, candidate_with(fail_probe))
    assert comparison.status == Status.NO_REGRESSION
    assert any("still fail" in line and "probe[candidate-g64]" in line for line in comparison.lines)
    improved = compare(baseline, BASELINE)
    assert improved.status == Status.NO_REGRESSION
    assert any("improved" in line and "probe[candidate-g64]" in line for line in improved.lines)


def test_a_check_that_passed_and_is_not_applicable_now_is_reported():
    def no_ledger(payload):
        for hashes in payload["hashes"]:
            hashes["ledger_status"] = "not-checked"

    comparison = compare(BASELINE, candidate_with(no_ledger))
    assert comparison.status == Status.NO_REGRESSION
    assert any("passed in the baseline, n/a now" in line for line in comparison.lines)


def change_hash(payload):
    payload["hashes"][2]["per_rank"] = [fake_hash("something else")] * 2


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


def slow_candidate(factor: float):
    """Every timed candidate step ``factor`` times as long: each block's speed-up / factor."""

    def edit(payload):
        for block in payload["performance"][0]["blocks"]:
            block["candidate_times_s"] = [time * factor for time in block["candidate_times_s"]]

    return edit


def test_a_speedup_interval_below_the_baseline_is_a_regression():
    comparison = compare(BASELINE, candidate_with(slow_candidate(1.02)))
    assert comparison.status == Status.REGRESSION
    [line] = regressions(comparison)
    assert "speed-up of 'candidate-g64' fell" in line
    assert "1.017x [1.016, 1.019]" in line and "baseline 1.037x [1.036, 1.039]" in line


def test_overlapping_or_better_speedup_intervals_do_not_regress():
    overlapping = compare(BASELINE, candidate_with(slow_candidate(1.001)))
    assert overlapping.status == Status.NO_REGRESSION
    assert any("unchanged within the intervals" in line for line in overlapping.lines)
    faster = compare(BASELINE, candidate_with(slow_candidate(0.95)))
    assert faster.status == Status.NO_REGRESSION
    assert any(line.startswith("improved: speed-up") for line in faster.lines)


def test_insufficient_blocks_are_not_compared():
    def two_blocks(payload):
        from qwz.qualify.evidence.rules import speed

        raw = payload["performance"][0]["blocks"][:2]
        payload["performance"][0] |= speed.summarize_blocks(raw)

    comparison = compare(BASELINE, candidate_with(two_blocks))
    assert comparison.status == Status.NO_REGRESSION
    assert any("insufficient blocks" in line for line in comparison.lines)


def grow_memory(factor: float):
    def edit(payload):
        for memory in payload["memory"]:
            if memory["arm"] == CANDIDATE:
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
        payload["memory"][-1]["peak_allocated_bytes"] *= 2

    assert compare(BASELINE, candidate_with(grow_rank_1)).status == Status.REGRESSION


def test_several_regressions_are_all_listed_first():
    def everything(payload):
        change_hash(payload)
        grow_memory(1.5)(payload)
        slow_candidate(1.15)(payload)

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
        text = json.dumps(payload).replace('"candidate-g64"', '"candidate-g128"')
        payload.clear()
        payload.update(json.loads(text))

    def regroup(payload):
        zero = payload["arms"][2]["config"]["zero_optimization"]
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
    now, newer = schema.SCHEMA_VERSION, schema.SCHEMA_VERSION + 1
    future = BASELINE.model_copy(update={"schema_version": newer})
    comparison = compare(BASELINE, future)
    assert comparison.status == Status.NOT_COMPARABLE
    assert f"schema major versions differ: {now} -> {newer}" in text(comparison)


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
    newer = schema.SCHEMA_VERSION + 1
    payload["schema_version"] = newer
    payload["digest"] = seal.canonical_digest(payload)
    future_path = tmp_path / "future.json"
    future_path.write_text(json.dumps(payload))
    comparison = compare_files(baseline_path, future_path)
    assert comparison.status == Status.NOT_COMPARABLE
    assert "candidate record rejected" in text(comparison)
    assert f"written by schema {newer}; this qwz reads up to {schema.SCHEMA_VERSION}" in text(
        comparison
    )


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


def native(sha: str, version: str = "0.19.8", dirty: bool = False, **edit) -> dict[str, Any]:
    """Overrides making a deepspeed-native record of DeepSpeed `version` at commit `sha`."""
    diff = "d" * 64 if dirty else None
    return {
        "head": {"repository": "/src/DeepSpeed", "sha": sha, "dirty": dirty, "diff_sha256": diff},
        "harness": {"repository": "qwz", "sha": "c" * 40, "dirty": False},
        "subject": {
            "name": "deepspeed-native", "version": version, "sha": sha, "dirty": dirty,
            "diff_sha256": diff, "import_path": "/src/DeepSpeed/deepspeed",
        },
        "environment": {"deepspeed": version},
        **edit,
    }  # fmt: skip


BASE_SHA, PR_SHA = "1" * 40, "2" * 40


def test_two_deepspeed_commits_compare_and_what_changed_is_apart_from_what_regressed():
    """`compare BASE HEAD` of two DeepSpeed commits of one version: comparable; the subject
    change and the hashes ("numerics changed") are reported, a failing check regresses."""
    baseline = make_record(**native(BASE_SHA))
    head = candidate_with(lambda p: (change_hash(p), fail_updates(p)), **native(PR_SHA))
    comparison = compare(baseline, head)
    assert comparison.status == Status.REGRESSION
    lines = comparison.lines
    assert "deepspeed-native: deepspeed 0.19.8 at 111111111111" in lines[0]
    assert "at 222222222222" in lines[1]
    [regression] = regressions(comparison)
    assert "'update[candidate-g64]' was pass in the baseline and is fail now" in regression
    heading = lines.index("what changed (reported, not judged):")
    assert lines.index(regression) < heading
    changed = lines[heading + 1 :]
    assert any(line.startswith("subject changed: deepspeed-native") for line in changed)
    [numerics] = [line for line in changed if "hash of 'candidate-g64'" in line]
    assert numerics.startswith("numerics changed:") and "head changed 111111111111" in numerics


def test_the_same_deepspeed_commit_must_reproduce_its_hashes():
    """Same commit, same environment, same harness: a changed hash is a regression; the
    same commit with an uncommitted edit is other code (reported only)."""
    baseline = make_record(**native(BASE_SHA))
    same = compare(baseline, candidate_with(change_hash, **native(BASE_SHA)))
    assert same.status == Status.REGRESSION
    assert "although head, subject and environment are the same" in regressions(same)[0]
    edited = compare(baseline, candidate_with(change_hash, **native(BASE_SHA, dirty=True)))
    assert edited.status == Status.NO_REGRESSION


def test_a_deepspeed_version_change_is_the_subject_for_native_records_only():
    """For deepspeed-native the version is the subject's: comparable, reported. For the qwz
    subject DeepSpeed's version is environment: not comparable."""
    comparison = compare(
        make_record(**native(BASE_SHA)), make_record(**native(PR_SHA, version="0.19.9"))
    )
    assert comparison.status == Status.NO_REGRESSION
    assert any("subject version changed: 0.19.8 -> 0.19.9" in line for line in comparison.lines)
    qwz = compare(
        make_record(environment={"deepspeed": "0.19.8"}),
        make_record(environment={"deepspeed": "0.19.9"}),
    )
    assert qwz.status == Status.NOT_COMPARABLE
    assert "environment.deepspeed: '0.19.8' -> '0.19.9'" in text(qwz)


def test_a_native_record_and_a_drop_in_record_are_not_comparable():
    drop_in = native(BASE_SHA)
    drop_in["subject"] = dict(drop_in["subject"], name="deepspeed")
    comparison = compare(make_record(**native(BASE_SHA)), make_record(**drop_in))
    assert comparison.status == Status.NOT_COMPARABLE
    assert "subjects differ: deepspeed-native -> deepspeed" in text(comparison)
