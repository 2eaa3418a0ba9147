"""Bounded, strict JSON input: ``qwz/jsonio.py`` ([Note: bounded JSON]).

Each refusal is checked for its one-line message naming the origin; the properties
feed random bytes, mutated valid documents and JSON edge cases and accept nothing
but a parsed value or a JsonInputError.
"""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwz import jsonio


def refused(text: str | bytes, match: str, limits: jsonio.Limits = jsonio.DEFAULT_LIMITS) -> str:
    data = text.encode() if isinstance(text, str) else text
    with pytest.raises(jsonio.JsonInputError, match=match) as error:
        jsonio.parse_json_bytes(data, origin="doc.json", limits=limits)
    message = str(error.value)
    assert message.startswith("doc.json: ") and "\n" not in message
    return message


def test_valid_documents_parse_as_json_does():
    text = '{"a": [1, -2, 3.5, 1e-400, true, null, "x\\u00e9"], "b": {"c": {}}}'
    assert jsonio.parse_json_text(text, origin="t") == json.loads(text)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(literal):
    refused(f'{{"x": {literal}}}', "NaN and Infinity are refused")


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "1" * 400 + ".0"])
def test_floats_beyond_the_float_range_are_refused(literal):
    refused(f"[{literal}]", "out of the float range")


def test_an_integer_of_5000_digits_is_refused_without_converting_it():
    message = refused("[" + "7" * 5000 + "]", "5,000 digits is out of the 64-bit range")
    assert len(message) < 200


@pytest.mark.parametrize(
    ("literal", "ok"),
    [
        (str(2**63 - 1), True),
        (str(-(2**63)), True),
        (str(2**63), False),
        (str(-(2**63) - 1), False),
        ("1" + "0" * 30, False),
    ],
)
def test_integers_are_bounded_to_64_bits(literal, ok):
    if ok:
        assert jsonio.parse_json_text(literal, origin="t") == int(literal)
    else:
        refused(literal, "64-bit range")


def test_a_list_nested_100000_deep_is_refused_before_parsing():
    message = refused("[" * 100_000 + "]" * 100_000, "nested 100000 levels deep")
    assert "more than the 64 allowed" in message


def test_depth_counts_brackets_outside_strings_only():
    inside = '"' + "[" * 1000 + '"'
    assert jsonio.parse_json_text(f'{{"a": [{inside}, "\\"[["]}}', origin="t")["a"][0] == "[" * 1000
    assert jsonio.nesting_depth(b"[[[]],{}]") == 3
    limits = jsonio.Limits(max_depth=3)
    jsonio.parse_json_bytes(b"[[[1]]]", origin="t", limits=limits)
    refused(b"[[[[1]]]]", "nested 4 levels deep", limits)


def test_duplicate_keys_are_refused():
    refused('{"a": 1, "b": {"c": 1, "c": 2}}', "duplicate key 'c'")


@pytest.mark.parametrize(
    "data",
    [b"\xff\xfe{}", b'{"a": "\xe9"}', bytes(range(256)), b"\x89PNG\r\n\x1a\n\x00\x00"],
    ids=["utf16-bom", "latin1", "all-bytes", "png"],
)
def test_binary_and_non_utf8_input_is_refused(data):
    refused(data, "not UTF-8 text")


def test_a_lone_surrogate_escape_is_refused():
    refused('["\\ud800"]', "lone surrogate")


@pytest.mark.parametrize("text", ["", "   \n", "\t"])
def test_empty_input_is_refused(text):
    refused(text, "empty")


def test_truncated_json_says_where():
    refused('{"a": [1, 2', r"not valid JSON \(truncated or corrupt\?\)")


def test_list_object_and_string_sizes_are_bounded():
    limits = jsonio.Limits(max_items=3, max_string=5)
    jsonio.parse_json_bytes(b'[1, 2, {"abcde": "12345"}]', origin="t", limits=limits)
    refused(b"[[1, 2, 3, 4]]", "a list of 4 items", limits)
    refused(b'{"a": 1, "b": 2, "c": 3, "d": 4}', "an object of 4 keys", limits)
    refused(b'["123456"]', "a string of 6 characters", limits)
    refused(b'{"abcdef": 1}', "a string of 6 characters", limits)


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def test_a_regular_file_is_read(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"a": 1}')
    assert jsonio.read_json_file(path) == {"a": 1}


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: _capture(outcome, fifo), daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], jsonio.JsonInputError)
    assert "a FIFO" in str(outcome[0]) and str(fifo) in str(outcome[0])


def _capture(outcome: list[BaseException], path) -> None:
    try:
        jsonio.read_json_file(path)
    except BaseException as error:
        outcome.append(error)


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), ("/dev/null", "a character device")]
)
def test_devices_are_refused(path, kind):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(jsonio.JsonInputError, match=kind):
        jsonio.read_json_file(path)


def test_a_directory_a_missing_file_and_an_empty_path(tmp_path):
    with pytest.raises(jsonio.JsonInputError, match="a directory"):
        jsonio.read_json_file(tmp_path)
    with pytest.raises(jsonio.JsonInputError, match="cannot read JSON file: No such file"):
        jsonio.read_json_file(tmp_path / "absent.json")
    with pytest.raises(jsonio.JsonInputError, match="an empty string is not a path"):
        jsonio.read_json_file("")


def test_a_file_larger_than_the_cap_is_refused(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "1," * 100 + "1]")
    with pytest.raises(jsonio.JsonInputError, match="more than the 64 allowed"):
        jsonio.read_json_file(path, limits=jsonio.Limits(max_bytes=64))


def test_bounded_repr_never_explodes():
    assert jsonio.bounded_repr(10**5000) == "<integer of about 5,001 digits>"
    long_list = jsonio.bounded_repr(list(range(1_000_000)))
    assert len(long_list) <= 200 and "(1,000,000 items)" in long_list
    assert len(jsonio.bounded_repr("x" * 10**6)) <= 200
    assert len(jsonio.bounded_repr([[list(range(10**5))] * 10**3])) <= 200

    class Hostile:
        def __repr__(self):
            raise RuntimeError("no")

    assert "Hostile" in jsonio.bounded_repr(Hostile())  # reported, not raised


# --------------------------------------------------------------------------- #
# Properties
# --------------------------------------------------------------------------- #

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


def _parse_or_refuse(data: bytes) -> None:
    try:
        jsonio.parse_json_bytes(data, origin="fuzz.json")
    except jsonio.JsonInputError as error:
        assert str(error).startswith("fuzz.json: ") and "\n" not in str(error)


@given(JSON_VALUES)
def test_every_bounded_json_value_round_trips(value):
    text = json.dumps(value, allow_nan=False)
    parsed = jsonio.parse_json_text(text, origin="t")
    assert json.dumps(parsed, sort_keys=True) == json.dumps(value, sort_keys=True)


@given(st.binary(max_size=300))
def test_random_bytes_parse_or_are_refused_in_one_line(data):
    _parse_or_refuse(data)


@st.composite
def mutated_documents(draw) -> bytes:
    data = bytearray(json.dumps(draw(JSON_VALUES), allow_nan=False).encode())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "splice"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(
                st.sampled_from(
                    [b"NaN", b"Infinity", b"1e400", b"[" * 200, b'"\\ud800"', b"9" * 30, b"\x00"]
                )
            )
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        else:
            data[at:at] = b'"k": 1, "k": 2, '
    return bytes(data)


@given(mutated_documents())
def test_mutated_documents_parse_or_are_refused_in_one_line(data):
    _parse_or_refuse(data)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_finite_floats_survive_exactly(number):
    parsed = jsonio.parse_json_text(json.dumps([number]), origin="t")[0]
    assert parsed == number and math.isfinite(parsed)
