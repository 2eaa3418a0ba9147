"""Bounded, strict JSON input: what qwz reads from files it did not write itself.

Records (``qwz.qualify.evidence.record.load``) and DeepSpeed-style configs
(``qwz.config.load_json_config``) come from disk, from other machines and from
people. ``json.loads`` alone trusts its input too much for that: it blocks on a
FIFO, reads ``/dev/zero`` until memory runs out, lets a duplicate key silently
replace the first, accepts ``NaN``/``Infinity`` and turns ``1e400`` into ``inf``,
raises ``ValueError`` on an integer of 5,000 digits and ``RecursionError`` on a
list nested 100,000 deep. Every one of those becomes a :class:`JsonInputError`
here, whose message is one line: ``ORIGIN: PROBLEM``.

[Note: bounded JSON]
  - Files: opened with ``O_NONBLOCK`` (a FIFO without writer opens at once) and
    checked with ``fstat`` before any read; only regular files are read, and at
    most ``max_bytes + 1`` bytes of them, so neither a FIFO nor a device can hang
    or exhaust memory.
  - Text: UTF-8 only; strings must be encodable back to UTF-8 (no lone
    surrogates from ``\\ud800`` escapes, which would break any later digest).
  - Nesting depth is measured on the bracket sequence outside string literals
    before ``json.loads`` runs, with no recursion, so ``json`` never recurses
    deeper than ``max_depth``.
  - Numbers: integers within the signed 64-bit range (checked on the digit
    string before conversion); floats finite (``1e400`` overflows to inf and is
    refused); the constants ``NaN``, ``Infinity``, ``-Infinity`` refused.
  - Containers: duplicate object keys refused; lists and objects at most
    ``max_items`` long; strings at most ``max_string`` characters.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import reprlib
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "JsonInputError",
    "Limits",
    "bounded_repr",
    "parse_json_bytes",
    "parse_json_text",
    "read_json_file",
    "read_regular_file",
]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


class JsonInputError(ValueError):
    """JSON input refused; ``str(error)`` is one line ``ORIGIN: PROBLEM``."""

    def __init__(self, origin: str, problem: str):
        self.origin = origin
        self.problem = _one_line(problem)
        super().__init__(f"{origin}: {self.problem}")


@dataclass(frozen=True)
class Limits:
    """Bounds on one JSON document; the defaults fit qwz's records and configs many times."""

    max_bytes: int = 16 * 1024 * 1024
    """Largest file accepted, in bytes (and largest text, in UTF-8 bytes)."""
    max_depth: int = 64
    """Deepest nesting of lists and objects."""
    max_items: int = 1_000_000
    """Longest list, and most keys in one object."""
    max_string: int = 1_000_000
    """Longest string (key or value), in characters."""


DEFAULT_LIMITS = Limits()

# A JSON string literal, escapes included (unrolled so the regex engine never backtracks).
_STRING_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]")
# Digits of the largest int64 magnitude; a longer digit string is out of range unchecked.
_INT64_DIGITS = len(str(INT64_MAX))


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def read_regular_file(path: str | os.PathLike[str], *, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` bytes; never blocks on a FIFO.

    Raises JsonInputError naming the path for a missing or unreadable path, a FIFO, a
    device, a directory, a socket, or a file larger than ``max_bytes``."""
    origin = bounded_repr(str(path), 200) if len(str(path)) > 200 else str(path)
    if origin == "":
        raise JsonInputError("''", f"an empty string is not a path to a {what}")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        raise JsonInputError(origin, f"cannot read {what}: {error.strerror or error}") from None
    except ValueError as error:  # an embedded NUL byte
        raise JsonInputError(origin, f"not a usable path: {error}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise JsonInputError(
                origin, f"not a regular file ({_file_kind(info.st_mode)}); refusing to read it"
            )
        if info.st_size > max_bytes:
            raise JsonInputError(
                origin, f"{what} is {info.st_size:,} bytes, more than the {max_bytes:,} allowed"
            )
        chunks = []
        remaining = max_bytes + 1  # one byte more tells a file that grew past the cap
        while remaining > 0:
            chunk = os.read(descriptor, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as error:
        raise JsonInputError(origin, f"cannot read {what}: {error.strerror or error}") from None
    finally:
        os.close(descriptor)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise JsonInputError(origin, f"{what} is larger than the {max_bytes:,} bytes allowed")
    return data


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_json_file(
    path: str | os.PathLike[str], *, limits: Limits = DEFAULT_LIMITS, what: str = "JSON file"
) -> Any:
    """Parse a regular UTF-8 JSON file under ``limits``; JsonInputError names the path."""
    data = read_regular_file(path, max_bytes=limits.max_bytes, what=what)
    return parse_json_bytes(data, origin=str(path), limits=limits)


def parse_json_bytes(data: bytes, *, origin: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    if len(data) > limits.max_bytes:
        raise JsonInputError(origin, f"{len(data):,} bytes, more than the {limits.max_bytes:,}")
    if not data.strip():
        raise JsonInputError(origin, "empty (no JSON value)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JsonInputError(
            origin,
            f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "binary or corrupt?",
        ) from None
    return _parse(text, data, origin, limits)


def parse_json_text(text: str, *, origin: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Parse JSON text under ``limits``; JsonInputError names ``origin``."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonInputError(origin, "text holds characters that are not valid UTF-8") from None
    return parse_json_bytes(data, origin=origin, limits=limits)


def _parse(text: str, data: bytes, origin: str, limits: Limits) -> Any:
    depth = nesting_depth(data)
    if depth > limits.max_depth:
        raise JsonInputError(
            origin, f"nested {depth} levels deep, more than the {limits.max_depth} allowed"
        )

    def parse_int(digits: str) -> int:
        magnitude = digits.lstrip("-")
        if len(magnitude) > _INT64_DIGITS:
            raise _Refused(f"integer of {len(magnitude):,} digits is out of the 64-bit range")
        value = int(digits)
        if not INT64_MIN <= value <= INT64_MAX:
            raise _Refused(f"integer {digits} is out of the 64-bit range")
        return value

    def parse_float(literal: str) -> float:
        value = float(literal)
        if value in (float("inf"), float("-inf")):
            raise _Refused(f"number {_one_line(literal, 40)} is out of the float range")
        return value

    def parse_constant(name: str) -> Any:
        raise _Refused(f"{name} is not a JSON number (NaN and Infinity are refused)")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len(items) > limits.max_items:
            raise _Refused(f"an object of {len(items):,} keys, more than {limits.max_items:,}")
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                raise _Refused(f"duplicate key {_one_line(repr(key), 60)} in one object")
            result[key] = value
        return result

    try:
        value = json.loads(
            text,
            parse_int=parse_int,
            parse_float=parse_float,
            parse_constant=parse_constant,
            object_pairs_hook=pairs,
        )
    except _Refused as refused:
        raise JsonInputError(origin, str(refused)) from None
    except json.JSONDecodeError as error:
        raise JsonInputError(
            origin,
            f"not valid JSON (truncated or corrupt?): {error.msg} at line {error.lineno} "
            f"column {error.colno}",
        ) from None
    except (RecursionError, ValueError, MemoryError) as error:  # belt and braces
        raise JsonInputError(origin, f"not acceptable JSON: {type(error).__name__}") from None
    _check_sizes(value, origin, limits)
    return value


class _Refused(ValueError):
    """Raised from inside json.loads' hooks; turned into JsonInputError with the origin."""


def nesting_depth(data: bytes) -> int:
    """Deepest bracket nesting of JSON ``data``, counted outside string literals.

    Exact for valid JSON; for invalid JSON it is an estimate that the parser's own
    error supersedes. Linear time, no recursion."""
    structure = _NOT_A_BRACKET.sub(b"", _STRING_LITERAL.sub(b"", data))
    if not structure:
        return 0
    codes = np.frombuffer(structure, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _check_sizes(value: Any, origin: str, limits: Limits) -> None:
    """Walk the parsed value (iteratively): list lengths, string lengths, UTF-8 strings."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item, origin, limits)
        elif isinstance(item, list):
            if len(item) > limits.max_items:
                raise JsonInputError(
                    origin, f"a list of {len(item):,} items, more than the {limits.max_items:,}"
                )
            stack.extend(element for element in item if isinstance(element, (str, list, dict)))
        elif isinstance(item, dict):
            for key, element in item.items():
                _check_string(key, origin, limits)
                if isinstance(element, (str, list, dict)):
                    stack.append(element)


def _check_string(text: str, origin: str, limits: Limits) -> None:
    if len(text) > limits.max_string:
        raise JsonInputError(
            origin, f"a string of {len(text):,} characters, more than the {limits.max_string:,}"
        )
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise JsonInputError(
                origin, "a string holds a lone surrogate escape (\\ud800-\\udfff), not Unicode"
            ) from None


class _BoundedRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 8
        self.maxstring = 80
        self.maxother = 80

    def repr_dict(self, x: dict, level: int) -> str:
        # reprlib sorts the keys; a message should show them as they were written.
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(key, level - 1)}: {self.repr1(x[key], level - 1)}"
            for key in itertools.islice(x, self.maxdict)
        ]
        if len(x) > self.maxdict:
            items.append("...")
        return "{" + ", ".join(items) + "}"

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:  # about 60 digits; repr() itself fails past 4300
            return f"<integer of about {int(x.bit_length() * 0.30103) + 1:,} digits>"
        return repr(x)


def bounded_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for an error message: at most ``limit`` characters, never raising
    (an integer of 5,000 digits, a list of a million items, a repr that raises)."""
    try:
        text = _BoundedRepr().repr(value)
    except Exception as error:  # a repr that raises must not hide the real error
        text = f"<{type(value).__name__}: repr failed: {type(error).__name__}>"
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        text += f" ({len(value):,} items)"
    return _one_line(text, limit)
