"""The rules a run setting's value follows, and ``setting()``, which declares one.

[Note: one declaration per setting]
Every setting of ``qwz-qualify run`` is one dataclass field (qualify/base/plan.py: ``RunPlan`` for
what the run trains and judges, ``Launch`` for how it is launched) declared with
``setting(default, rule, help)``. The field's name is the setting's one name: the ``run``
flag (``--allgather-bucket-size``), the attribute of the parsed arguments, the matrix spec's
key (``allgather_bucket_size = 65536``), a preset's key and the record's plan key. Its rule
(below) refuses a bad value with one message wherever the value comes from: command-line
text (``parse``) or a TOML or Python value (``check``). qualify/request/settings.py generates the
``run`` flags, the presets' overrides and the matrix spec's keys from these fields, so adding
a setting is adding one field.

A rule knows nothing of the fields it serves; ``OneOf`` may name its choices by a vocabulary
(``OneOf.vocabulary("workload")``) that qualify/request/settings.py supplies, where the names are
known (the workloads and presets live above this module's layer).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwz.config import validate_group_size

SETTING = "qwz.setting"
"""The metadata key of a field declared with ``setting()``."""
LONGEST_NUMBER_TEXT = 60
"""Command-line numbers longer than this are refused before conversion (no 10**6-digit int)."""


def shown(value: Any) -> str:
    """A value as a refusal quotes it: its repr, shortened past 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Rule:
    """What values a setting accepts: ``check`` a Python value, ``parse`` command-line text.
    Both return the value or raise ValueError with a message that names the value and says
    what it must be."""

    what: str = "a value"
    choices: tuple[Any, ...] | None = None

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        return self.check(text)

    def refuse(self, value: Any) -> ValueError:
        return ValueError(f"{shown(value)} is invalid: must be {self.what}")

    def parse_checked(self, text: str, value: Any) -> Any:
        """`value`, parsed from `text`, checked; a refusal quotes the text as it was typed."""
        try:
            return self.check(value)
        except ValueError:
            raise ValueError(f"{text} is invalid: must be {self.what}") from None


@dataclass(frozen=True)
class Integer(Rule):
    low: int
    high: int | None = None
    what: str = "an integer"

    def check(self, value: Any) -> int:
        if type(value) is not int or value < self.low or (self.high and value > self.high):
            raise self.refuse(value)
        return value

    def parse(self, text: str) -> int:
        try:
            if len(text) > 30:
                raise ValueError
            value = int(text)
        except ValueError:
            raise ValueError(f"{shown(text)} is not an integer (digits, at most 30)") from None
        return self.parse_checked(text, value)


@dataclass(frozen=True)
class Real(Rule):
    accept: Callable[[float], bool]
    what: str = "a number"

    def check(self, value: Any) -> float:
        if type(value) not in (int, float) or not self.accept(float(value)):
            raise self.refuse(value)
        return float(value)

    def parse(self, text: str) -> float:
        try:
            if len(text) > LONGEST_NUMBER_TEXT:
                raise ValueError
            value = float(text)
        except ValueError:
            raise ValueError(f"{shown(text)} is not a number") from None
        return self.parse_checked(text, value)


class OneOf(Rule):
    """One of a tuple of names; or of a vocabulary's names, supplied by
    qualify/request/settings.py."""

    def __init__(self, choices: tuple[str, ...] = (), vocabulary: str | None = None) -> None:
        self.choices = tuple(choices)
        self.vocabulary_name = vocabulary

    @classmethod
    def vocabulary(cls, name: str) -> OneOf:
        return cls(vocabulary=name)

    def resolved(self, vocabularies: dict[str, tuple[str, ...]]) -> OneOf:
        if self.vocabulary_name is None:
            return self
        return OneOf(vocabularies[self.vocabulary_name])

    @property
    def what(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(self.choices)

    def check(self, value: Any) -> str:
        if value not in self.choices:
            raise self.refuse(value)
        return value


class Boolean(Rule):
    what = "true or false"

    def check(self, value: Any) -> bool:
        if type(value) is not bool:
            raise self.refuse(value)
        return value


class Path(Rule):
    what = "a usable path (non-empty, no NUL)"

    def check(self, value: Any) -> pathlib.Path:
        if isinstance(value, pathlib.Path):
            value = str(value)
        if not isinstance(value, str) or not value or "\0" in value:
            raise self.refuse(value)
        return pathlib.Path(value)

    def parse(self, text: str) -> pathlib.Path:
        if not text or "\0" in text:
            raise ValueError(f"{shown(text)} is not a usable path")
        return pathlib.Path(text)


class GroupSize(Rule):
    """One quantization group size: a positive multiple of 8 (qwz.config's rule)."""

    what = "a positive multiple of 8"

    def check(self, value: Any) -> int:
        if type(value) is not int:
            raise self.refuse(value)
        try:
            return validate_group_size(value, stage=2, key="group size")
        except ValueError as error:
            raise ValueError(str(error).removeprefix("group size: ")) from None

    def parse(self, text: str) -> int:
        return self.check(Integer(-(2**62)).parse(text))


@dataclass(frozen=True)
class Optional(Rule):
    """None (the field's default meaning) or a value of ``rule``."""

    rule: Rule

    @property
    def what(self) -> str:  # type: ignore[override]
        return self.rule.what

    def check(self, value: Any) -> Any:
        return None if value is None else self.rule.check(value)

    def parse(self, text: str) -> Any:
        return self.rule.parse(text)


POSITIVE = Integer(1, what="a positive integer")
NON_NEGATIVE = Integer(0, what="an integer >= 0")
SEED = Integer(0, 2**63 - 1, what="in [0, 2**63 - 1]")
STAGE = Integer(1, 2, what="ZeRO stage 1 or 2")
POSITIVE_FINITE = Real(lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
NON_NEGATIVE_FINITE = Real(lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")
FINITE = Real(math.isfinite, "a finite number")
BOOLEAN = Boolean()
PATH = Path()


@dataclass(frozen=True)
class Setting:
    """What ``setting()`` records of a field (qualify/request/settings.py reads it)."""

    rule: Rule
    help: str
    matrix: str | None = "setting"
    """"axis" (a matrix axis: part of a cell's id), "setting" (one value per cell group), or
    None (not the matrix spec's to set: given to the ``matrix`` command, or a test seam)."""
    flag: str | None = None
    """The ``run`` flag where it is not ``--`` + the name with dashes (``--group-size``,
    repeated, for ``group_sizes``)."""
    repeated: bool = False
    """A tuple of values, one per use of the flag (``rule`` checks one element)."""


def setting(
    default: Any,
    rule: Rule,
    help: str,
    *,
    matrix: str | None = "setting",
    flag: str | None = None,
    repeated: bool = False,
) -> Any:
    """A dataclass field that is a run setting ([Note: one declaration per setting])."""
    declared = Setting(rule, help, matrix, flag, repeated)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={SETTING: declared})
    return dataclasses.field(default=default, metadata={SETTING: declared})
