"""Malformed record files: one RecordError line naming the file, and exit 2 from ``report``
and ``compare`` with that line and no traceback (issue 9, "Strict schema").

Every case of the issue is one parametrized row; the fuzz properties at the end feed
random bytes and mutated valid records to ``record.load``.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwz.qualify import cli
from qwz.qualify.evidence import record, schema, seal
from tests.unit.records import make_payload, make_record


def saved(directory: pathlib.Path, name: str = "record.json", **overrides) -> pathlib.Path:
    path = directory / name
    record.save(make_record(**overrides), path)
    return path


def sealed_text(edit) -> str:
    """A valid record's JSON with ``edit`` applied to the payload and the digest recomputed,
    so that only the rule under test can refuse it."""
    payload = make_record().model_dump(mode="json")
    edit(payload)
    payload["digest"] = seal.canonical_digest(payload)
    return json.dumps(payload, indent=2)


def _set(*keys_and_value):
    *keys, last, value = keys_and_value

    def edit(payload):
        target = payload
        for key in keys:
            target = target[key]
        target[last] = value

    return edit


def _text_with(old: str, new: str):
    """The saved record text with one literal replaced (digest not recomputable: JSON with
    NaN or a 1e400 cannot be digested; the loader must refuse it before the digest)."""

    def write(path: pathlib.Path) -> None:
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))

    return write


MEMORY_FIELD = '"peak_allocated_bytes": 61341696'

# (id, how to corrupt the saved record file, the message it must give)
CASES = [
    ("nan-literal", _text_with(MEMORY_FIELD, '"peak_allocated_bytes": NaN'), "NaN"),
    ("infinity-literal", _text_with('"max_ratio": 0.49', '"max_ratio": Infinity'), "Infinity"),
    ("minus-infinity", _text_with('"max_ratio": 0.49', '"max_ratio": -Infinity'), "Infinity"),
    ("1e400", _text_with('"max_ratio": 0.49', '"max_ratio": 1e400'), "out of the float range"),
    ("binary", lambda p: p.write_bytes(bytes(range(256)) * 4), "not UTF-8"),
    ("non-utf8", lambda p: p.write_bytes(p.read_bytes().replace(b"tiny", b"t\xefny")), "not UTF-8"),
    ("empty", lambda p: p.write_bytes(b""), "empty"),
    ("deep-nesting", lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested 100000"),
    (
        "5000-digit-integer",
        _text_with(MEMORY_FIELD, '"peak_allocated_bytes": ' + "9" * 5000),
        "5,000 digits",
    ),
    (
        "huge-integer-in-memory",
        _text_with(MEMORY_FIELD, '"peak_allocated_bytes": 1' + "0" * 30),
        "64-bit range",
    ),
    (
        "duplicate-key",
        _text_with('"world_size": 2,', '"world_size": 2, "world_size": 64,'),
        "duplicate key 'world_size'",
    ),
    (
        "string-for-int",
        lambda p: p.write_text(sealed_text(_set("environment", "world_size", "2"))),
        "environment.world_size: Input should be a valid integer",
    ),
    (
        "string-for-bool",
        lambda p: p.write_text(sealed_text(_set("head", "dirty", "false"))),
        "head.dirty: Input should be a valid boolean",
    ),
    (
        "bool-for-schema-version",
        lambda p: p.write_text(sealed_text(_set("schema_version", True))),
        "schema_version True is not an integer",
    ),
    (
        "float-for-int",
        lambda p: p.write_text(sealed_text(_set("workload", "steps", 20.0))),
        "workload.steps: Input should be a valid integer",
    ),
    (
        "lone-surrogate",
        _text_with('"tiny-qwen3"', '"tiny-\\ud800"'),
        "lone surrogate",
    ),
]


@pytest.mark.parametrize(("corrupt", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_record_is_one_line_naming_the_file(tmp_path, corrupt, message):
    path = saved(tmp_path)
    corrupt(path)
    with pytest.raises(schema.RecordError, match=message.replace("(", r"\(")) as error:
        record.load(path)
    text = str(error.value)
    assert text.startswith(f"{path}: ") and "\n" not in text and len(text) < 500


@pytest.mark.parametrize(("corrupt", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_report_and_compare_exit_2_with_the_line(tmp_path, capsys, corrupt, message):
    good = saved(tmp_path, "good.json")
    bad = saved(tmp_path, "bad.json")
    corrupt(bad)
    assert cli.main(["report", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"qwz-qualify report: error: {bad}: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert cli.main(["compare", str(good), str(bad)]) == 2
    captured = capsys.readouterr()  # [Note: one error style]: stderr, the program's name
    assert captured.out == "" and captured.err.count("\n") == 1
    said = f"qwz-qualify compare: error: candidate record rejected: {bad}: "
    assert captured.err.startswith(said)
    assert "Traceback" not in captured.err


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "record.json"
    os.mkfifo(fifo)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(cli.main(["report", str(fifo)])))
    worker.daemon = True
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "report blocked on a FIFO"
    assert codes == [2]
    assert "not a regular file (a FIFO)" in capsys.readouterr().err


def test_dev_zero_is_refused(capsys):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    assert cli.main(["report", "/dev/zero"]) == 2
    assert "/dev/zero: not a regular file (a character device)" in capsys.readouterr().err


def test_a_directory_is_refused(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "a directory" in capsys.readouterr().err


def test_a_null_loss_is_reported_as_a_failure(tmp_path, capsys):
    payload = make_payload()
    payload["trajectories"][1]["losses"][-1] = None
    path = tmp_path / "record.json"
    record.save(seal.seal(payload), path)
    assert cli.main(["report", str(path)]) == 0
    assert "`finite[calibration-g64]` | **FAIL**" in capsys.readouterr().out


def test_schema_problems_are_listed_on_one_line(tmp_path):
    def many(payload):
        payload["environment"]["world_size"] = "2"
        payload["head"]["dirty"] = "false"
        payload["workload"]["steps"] = "20"
        payload["workload"]["seed"] = "1"

    path = tmp_path / "record.json"
    path.write_text(sealed_text(many))
    with pytest.raises(schema.RecordError, match="and 1 more") as error:
        record.load(path)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- #
# Fuzz: nothing but a Record or a one-line RecordError
# --------------------------------------------------------------------------- #

VALID_TEXT = json.dumps(make_record().model_dump(mode="json"), indent=2)


def _load_or_refuse(path: pathlib.Path) -> None:
    try:
        record.load(path)
    except schema.RecordError as error:
        assert str(error).startswith(f"{path}: ") and "\n" not in str(error)


@st.composite
def mutated_records(draw) -> bytes:
    data = bytearray(VALID_TEXT.encode())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "insert", "delete"]))
        if kind == "flip":
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(
                st.sampled_from(
                    [
                        *(b"NaN", b"-Infinity", b"1e400", b"null", b'"2"', b"true", b"[" * 80),
                        *(b"\xff", b"9" * 25, b'"x": 1, ', b"{}", b"[]", b"-0", b"0.0"),
                    ]
                )
            )
        else:
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@st.composite
def retyped_records(draw) -> str:
    """A valid record with one leaf replaced by a JSON value of any type, often resealed."""
    payload = make_record().model_dump(mode="json")
    parent: dict | list = payload
    key: str | int = draw(st.sampled_from(sorted(payload)))
    while isinstance(parent[key], (dict, list)) and parent[key]:
        parent = parent[key]
        key = draw(
            st.sampled_from(sorted(parent) if isinstance(parent, dict) else range(len(parent)))
        )
    parent[key] = draw(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=5)
        | st.just([])
        | st.just({})
    )
    if draw(st.booleans()):
        payload["digest"] = seal.canonical_digest(payload)
    return json.dumps(payload)


_FUZZ = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(data=mutated_records())
def test_mutated_record_files_load_or_are_refused(tmp_path, data):
    path = tmp_path / "fuzz.json"
    path.write_bytes(data)
    _load_or_refuse(path)


@_FUZZ
@given(text=retyped_records())
def test_retyped_and_resealed_records_load_or_are_refused(tmp_path, text):
    path = tmp_path / "fuzz.json"
    path.write_text(text)
    _load_or_refuse(path)


@_FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes_are_refused(tmp_path, data):
    path = tmp_path / "fuzz.json"
    path.write_bytes(data)
    with pytest.raises(schema.RecordError):
        record.load(path)
