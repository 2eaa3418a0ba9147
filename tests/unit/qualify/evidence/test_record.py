"""Loading an evidence record never silently passes: ``qwz/qualify/evidence/schema.py``.

Each tampering test changes one thing and, where a later rule could also catch it,
recomputes the digest so that only the rule under test stands between the file and
a successful load.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from qwz.qualify.evidence import record, schema, seal
from tests.unit.records import make_payload, make_record, violation


def saved(tmp_path: pathlib.Path, **overrides: Any) -> pathlib.Path:
    path = tmp_path / "record.json"
    record.save(make_record(**overrides), path)
    return path


def rewrite(path: pathlib.Path, edit, *, redigest: bool) -> None:
    """Apply ``edit`` to the JSON object in ``path``; optionally recompute its digest."""
    payload = json.loads(path.read_text())
    edit(payload)
    if redigest:
        payload["digest"] = seal.canonical_digest(payload)
    path.write_text(json.dumps(payload, indent=2))


def test_round_trip(tmp_path):
    original = make_record()
    path = tmp_path / "record.json"
    record.save(original, path)
    loaded = record.load(path)
    assert loaded == original
    assert loaded.digest == seal.canonical_digest(json.loads(path.read_text()))
    assert loaded.verdict.passed and loaded.verdict.failed == []


def test_round_trip_of_a_failing_record(tmp_path):
    updates = make_payload()["updates"]
    updates[2] |= {"violations": 3, "first_violation": violation(step=7, rank=1, ratio=4.5)}
    loaded = record.load(saved(tmp_path, updates=updates))
    assert not loaded.verdict.passed and loaded.verdict.status == "FAIL"
    assert loaded.verdict.failed == ["update[candidate-g64]"]
    check = next(check for check in loaded.checks if check.name == "update[candidate-g64]")
    assert "step 7, rank 1, lm_head.weight[12]" in check.detail


def test_an_edited_number_breaks_the_digest(tmp_path):
    path = saved(tmp_path)

    def faster(payload):
        payload["performance"][0]["median_speedup"] = 1.2

    rewrite(path, faster, redigest=False)
    with pytest.raises(schema.RecordError, match="digest") as error:
        record.load(path)
    assert str(path) in str(error.value)


def test_a_truncated_file_is_not_valid_json(tmp_path):
    path = saved(tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(schema.RecordError, match="not valid JSON"):
        record.load(path)


def test_a_missing_file(tmp_path):
    with pytest.raises(schema.RecordError, match="cannot read"):
        record.load(tmp_path / "absent.json")


def test_a_json_array_is_not_a_record(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("[1, 2]\n")
    with pytest.raises(schema.RecordError, match="JSON object"):
        record.load(path)


@pytest.mark.parametrize("version", [0, 1, "2", None])
def test_wrong_schema_version(tmp_path, version):
    path = saved(tmp_path)
    rewrite(path, lambda payload: payload.update(schema_version=version), redigest=True)
    with pytest.raises(schema.RecordError, match="schema_version"):
        record.load(path)


def test_a_record_of_a_newer_schema_names_both_versions(tmp_path):
    """Refused by its version, before pydantic's "Extra inputs are not permitted"."""
    path = saved(tmp_path)
    newer = schema.SCHEMA_VERSION + 1
    rewrite(
        path, lambda payload: payload.update(schema_version=newer, a_field_of_4=1), redigest=True
    )
    with pytest.raises(schema.RecordError) as caught:
        record.load(path)
    assert f"written by schema {newer}; this qwz reads up to {schema.SCHEMA_VERSION}" in str(
        caught.value
    )
    assert "Extra inputs" not in str(caught.value)


def _add_top_level_field(payload):
    payload["speedup_claimed"] = 1.9


def _add_nested_field(payload):
    payload["environment"]["gpu_clock_mhz"] = 1980


def _drop_top_level_field(payload):
    del payload["updates"]


def _drop_nested_field(payload):
    del payload["performance"][0]["ci_low"]


def _wrong_type(payload):
    payload["workload"]["steps"] = "twenty"


@pytest.mark.parametrize(
    "edit",
    [
        _add_top_level_field,
        _add_nested_field,
        _drop_top_level_field,
        _drop_nested_field,
        _wrong_type,
    ],
)
def test_schema_violations(tmp_path, edit):
    path = saved(tmp_path)
    rewrite(path, edit, redigest=True)
    with pytest.raises(schema.RecordError, match="does not match the record schema"):
        record.load(path)


def test_a_verdict_that_does_not_follow_from_the_checks(tmp_path):
    """The verdict flipped to FAIL, the digest recomputed: only the verdict rule is left."""
    path = saved(tmp_path)

    def flip(payload):
        payload["verdict"] |= {"status": "FAIL", "passed": False}

    rewrite(path, flip, redigest=True)
    with pytest.raises(schema.RecordError, match="verdict"):
        record.load(path)


def test_a_stored_check_that_does_not_follow_from_the_data(tmp_path):
    """A failing update check doctored to pass (verdict and digest made to match): the
    checks are derived again on load, from the observations, and disagree."""
    updates = make_payload()["updates"]
    updates[2]["violations"] = 5
    path = saved(tmp_path, updates=updates)

    def doctor(payload):
        for check in payload["checks"]:
            check["status"] = "pass"
        payload["verdict"] = {
            "status": "PASS",
            "passed": True,
            "failed": [],
            "inconclusive": [],
            "evidence": payload["verdict"]["evidence"],
            "not_applicable": payload["verdict"]["not_applicable"],
        }

    rewrite(path, doctor, redigest=True)
    with pytest.raises(
        schema.RecordError,
        match=r"update\[candidate-g64\].*rule unchanged but the result differs: bump the rule "
        r"version, or the record was altered",
    ):
        record.load(path)


@pytest.mark.parametrize(
    "field, value",
    [("median_speedup", 9.9), ("ci_low", 9.0), ("ci_high", 10.0), ("p_value", 1e-9)],
)
def test_a_doctored_speed_summary_is_refused(tmp_path, field, value):
    """The issue's resealed record: speed-up numbers edited and the digest recomputed. The
    summary is derived again from the recorded step times."""
    path = saved(tmp_path)
    rewrite(path, lambda payload: payload["performance"][0].update({field: value}), redigest=True)
    with pytest.raises(schema.RecordError, match=f"performance .*{field}"):
        record.load(path)


def test_an_empty_trajectory_cannot_pass_finite(tmp_path):
    """Losses emptied and the stored finite check left at pass: re-derivation refuses it."""
    path = saved(tmp_path)

    def empty(payload):
        payload["trajectories"][0]["losses"] = []

    rewrite(path, empty, redigest=True)
    with pytest.raises(schema.RecordError, match=r"finite\[reference\]"):
        record.load(path)


def test_negative_memory_is_a_schema_violation(tmp_path):
    path = saved(tmp_path)
    rewrite(
        path, lambda payload: payload["memory"][0].update(peak_allocated_bytes=-1), redigest=True
    )
    with pytest.raises(schema.RecordError, match="schema"):
        record.load(path)


def test_seal_refuses_an_invalid_payload():
    with pytest.raises(schema.RecordError, match="invalid"):
        seal.seal(make_payload(environment={"world_size": "two"}))


def test_published_schema_is_generated():
    """record.schema.json is regenerated by ``python -m qwz.qualify.evidence.schema``, never
    edited."""
    published = json.loads(schema.SCHEMA_PATH.read_text())
    assert published == schema.json_schema(), (
        "record.schema.json is stale: run `python -m qwz.qualify.evidence.schema`"
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda payload: payload["updates"][0].update(max_ratio=0),
        lambda payload: payload.pop("schema_version"),
    ],
    ids=["int-for-float", "default-omitted"],
)
def test_sealed_payload_that_pydantic_normalizes_loads_back(tmp_path, edit):
    """seal() digests the validated model, so pydantic's normalisation (an int in a float
    field, an omitted default) cannot make a fresh record fail load()."""
    payload = make_payload()
    edit(payload)
    path = tmp_path / "record.json"
    record.save(seal.seal(payload), path)
    record.load(path)
