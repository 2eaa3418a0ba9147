"""A matrix spec: TOML in, validated cells out.

The file::

    [matrix]
    name = "upstream-scope"            # required: names the matrix in its table
    description = "..."                # optional

    [defaults]                         # optional: settings every group starts from
    blocks = 2

    [[cells]]                          # one or more cell groups
    name = "stages"                    # required, unique: names the group in refusals
    subject = ["qwz", "deepspeed"]     # axes: a list of values, or one value
    stage = [1, 2]
    dtype = ["bf16", "fp32"]
    group_sizes = [[64, 8192]]         # each value: one G, or a list of Gs (arms of one run)
    workload = "mlp"
    world_size = [2, 4]
    preset = "default"
    seed = [0, 1]
    steps = 6                          # settings: one value for every cell of the group

    [[cells.exclude]]                  # cells of this group not run, with the reason
    subject = "deepspeed"
    world_size = 4
    reason = "..."

    [[out_of_scope]]                   # a scope no cell covers, listed with its reason
    scope = "offload"
    reason = "offload: not supported by the quantized gather"

How axes combine: each ``[[cells]]`` group is the full product of its axes (an axis it does
not name has ``run``'s default value); an ``exclude`` entry removes every cell of its group
whose axis values equal all the entry's (a value may be a list: any of them), and the
removed cells stay in the table as "not run" with the entry's reason. A single cell is a
group whose axes have one value each. Two cells with the same id (the same axis values,
``Cell.id``) are refused, even across groups: the id is the cell's directory.

Keys: the axes and the settings are ``run``'s settings by their one name
([Note: one declaration per setting], qualify/base/values.py): an axis (``AXES``) is part of a
cell's id; every other run setting (``matrix_settings()``: ``steps``, ``kernels``,
``allgather_bucket_size``, ...) takes one value per group, passed as its ``run`` flag.
A path (``ds_config = "pr.json"``) is relative to the spec file.
Two keys of earlier specs are read as what they meant (``RENAMED_KEYS``): ``bucket_size``
sets both buckets, ``compile = false`` is ``kernels = "eager"``.

Strictness: an unknown key, a value of the wrong type or outside its rule, an exclude that
matches no cell, or an empty matrix is a ``SpecError`` naming the file, the line where it
can be found, the key and the rule. The names of the axes' values are the run interface's
(``--dtype fp16``, ``--workload moe-tiny``, ``--preset long`` included): a value this
build's ``run`` does not offer yet is accepted here, and ``run`` refuses that cell (exit
2), which the table shows as "not run" with ``run``'s reason.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qwz.qualify.request import settings as run_settings
from qwz.qualify.request.settings import RunSetting

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the package tomli (the qualify extra)
    import tomli as tomllib

MAX_CELLS = 4096
"""More cells than this is a spec error, not a matrix (the product grows fast)."""
ID_AXES = ("subject", "stage", "dtype", "group_sizes", "workload", "world_size", "preset", "seed")
"""The axes in the order ``Cell.id`` writes them (a cell's id is its directory's name)."""


class SpecError(ValueError):
    """A spec that cannot be run; the message names the file, line and key."""


def _axes() -> dict[str, RunSetting]:
    declared = run_settings.run_settings()
    axes = {name: item for name, item in declared.items() if item.matrix == "axis"}
    if set(axes) != set(ID_AXES):
        raise AssertionError(f"the matrix axes {sorted(axes)} are not Cell.id's {ID_AXES}")
    return {name: axes[name] for name in ID_AXES}


AXES = _axes()
"""Axis name -> its run setting, in ``Cell.id`` order ([Note: one declaration per
setting], qualify/base/values.py)."""


def matrix_settings() -> dict[str, RunSetting]:
    """Setting name -> its run setting: every run setting a cell group may set, one value
    for all its cells (read from the declarations each time: a setting added is one)."""
    declared = run_settings.run_settings()
    return {name: item for name, item in declared.items() if item.matrix == "setting"}


RENAMED_KEYS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "bucket_size": lambda value: {"allgather_bucket_size": value, "reduce_bucket_size": value},
    "compile": lambda value: (
        {"kernels": "fused" if value is True else "eager"}
        if type(value) is bool
        else {"kernels": value}
    ),
}
"""Keys of earlier specs -> the settings they meant: a spec written before a rename still
runs the cells it ran (``bucket_size`` set both buckets; ``compile = false`` meant eager)."""


# --------------------------------------------------------------------------- #
# Cells
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Cell:
    """One qualification run of the matrix."""

    group: str
    axes: tuple[tuple[str, Any], ...]
    """(axis, value) in ``AXES`` order, every axis present."""
    settings: tuple[tuple[str, Any], ...]
    """(setting, value), sorted, only those the spec sets."""

    def value(self, axis: str) -> Any:
        return dict(self.axes)[axis]

    @property
    def id(self) -> str:
        """Stable and readable, from the axis values alone, e.g.
        ``qwz-s2-bf16-g64+8192-mlp-w2-default-seed0`` (a directory name)."""
        values = dict(self.axes)
        return "-".join(
            (
                values["subject"],
                f"s{values['stage']}",
                values["dtype"],
                "g" + "+".join(map(str, values["group_sizes"])),
                values["workload"],
                f"w{values['world_size']}",
                values["preset"],
                f"seed{values['seed']}",
            )
        )

    def run_arguments(self) -> list[str]:
        """The ``run`` arguments of this cell, without ``--out``: every axis but a default
        preset (a ``run`` without ``--preset`` runs the default), then every setting."""
        arguments: list[str] = []
        for axis, value in self.axes:
            if not (axis == "preset" and value == AXES["preset"].default):
                arguments += AXES[axis].arguments(value)
        for setting, value in self.settings:
            arguments += matrix_settings()[setting].arguments(value)
        return arguments


@dataclass(frozen=True)
class Declared:
    """A row of the table that is not run by design: an excluded cell or a scope."""

    id: str
    reason: str
    kind: str
    """``excluded`` (a cell an exclude entry removed) or ``out of scope``."""
    axes: tuple[tuple[str, Any], ...] = ()
    """An excluded cell's axis values (as ``Cell.axes``); none for a scope."""


@dataclass(frozen=True)
class Spec:
    path: pathlib.Path
    name: str
    description: str
    cells: tuple[Cell, ...]
    declared: tuple[Declared, ...]


# --------------------------------------------------------------------------- #
# Reading
# --------------------------------------------------------------------------- #

TOP_KEYS = ("matrix", "defaults", "cells", "out_of_scope")
MATRIX_KEYS = ("name", "description")
EXCLUDE_KEYS = (*AXES, "reason")
SCOPE_KEYS = ("scope", "reason")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


class _Where:
    """File and line of a table or key, found in the text (tomllib keeps no positions):
    ``fail`` raises a SpecError that starts with ``path:line:`` where the line is found."""

    def __init__(self, text: str, path: pathlib.Path) -> None:
        self.lines = text.splitlines()
        self.path = path

    def headers(self, name: str, array: bool) -> list[int]:
        opening, closing = (r"\[\[", r"\]\]") if array else (r"\[", r"\]")
        pattern = re.compile(rf"\s*{opening}\s*{re.escape(name)}\s*{closing}")
        return [number for number, line in enumerate(self.lines) if pattern.match(line)]

    def section(self, name: str, index: int | None = None, after: int = -1) -> int | None:
        """The line of table `name` (the `index`-th of an array of tables after `after`)."""
        found = [line for line in self.headers(name, index is not None) if line > after]
        position = 0 if index is None else index
        return found[position] if position < len(found) else None

    def exclude(self, group: int, number: int, group_start: int | None) -> int | None:
        """The line of the `number`-th ``[[cells.exclude]]`` of the `group`-th group; the
        group's ``exclude =`` line where its excludes are written inline."""
        following = self.section("cells", group + 1)
        found = [
            line
            for line in self.headers("cells.exclude", array=True)
            if (group_start is None or line > group_start)
            and (following is None or line < following)
        ]
        return found[number] if number < len(found) else self.key(group_start, "exclude")

    def key(self, start: int | None, key: str) -> int | None:
        """The line of `key = ...` in the table opening at `start` (None: the top level)."""
        pattern = re.compile(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for number in range(0 if start is None else start + 1, len(self.lines)):
            line = self.lines[number]
            if line.lstrip().startswith("["):
                break
            if pattern.match(line):
                return number
        return start

    def fail(self, message: str, start: int | None = None, key: str | None = None) -> SpecError:
        line = self.key(start, key) if key is not None else start
        place = f"{self.path}:{line + 1}" if line is not None else str(self.path)
        return SpecError(f"{place}: {message}")


def _table(value: Any, what: str, known: tuple[str, ...], where: _Where, start: int | None):
    if not isinstance(value, dict):
        raise where.fail(f"{what} must be a table, not {type(value).__name__}", start)
    for key in value:
        if key not in known:
            raise where.fail(f"{what}: unknown key {key!r} (known: {', '.join(known)})", start, key)
    return value


def _text(value: Any, what: str, where: _Where, start: int | None, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise where.fail(f"{what}: {key} must be a non-empty string, not {value!r}", start, key)
    return value.strip()


def load(path: str | pathlib.Path) -> Spec:
    """The spec in the TOML file at `path`, validated and expanded (module docstring)."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read the spec: {error}") from None
    return parse(text, path)


def parse(text: str, path: pathlib.Path) -> Spec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SpecError(f"{path}: not a valid TOML file: {error}") from None
    where = _Where(text, path)
    _table(data, "the spec", TOP_KEYS, where, None)
    header = where.section("matrix")
    if "matrix" not in data:
        raise where.fail("the spec has no [matrix] table (it needs at least its name)")
    matrix = _table(data["matrix"], "[matrix]", MATRIX_KEYS, where, header)
    name = _text(matrix.get("name"), "[matrix]", where, header, "name")
    description = matrix.get("description", "")
    if not isinstance(description, str):
        raise where.fail("[matrix]: description must be a string", header, "description")
    defaults_start = where.section("defaults")
    defaults = data.get("defaults", {})
    _table(defaults, "[defaults]", (*matrix_settings(), *RENAMED_KEYS), where, defaults_start)
    settings = _settings(defaults, "[defaults]", where, defaults_start)
    groups = data.get("cells")
    if not isinstance(groups, list) or not groups:
        raise where.fail("the spec has no [[cells]] group: a matrix needs at least one cell")
    cells: list[Cell] = []
    declared: list[Declared] = []
    for index, raw in enumerate(groups):
        group_cells, group_declared = _group(raw, index, settings, where)
        cells += group_cells
        declared += group_declared
    declared += _scopes(data.get("out_of_scope", []), where)
    _check_unique(cells, declared, where)
    if not cells:
        raise where.fail("every cell is excluded: the matrix would run nothing")
    return Spec(path, name, description, tuple(cells), tuple(declared))


def _settings(raw: Mapping[str, Any], what: str, where: _Where, start: int | None) -> dict:
    settings, known = {}, matrix_settings()
    for key, value in raw.items():
        if key not in known and key not in RENAMED_KEYS:
            continue
        try:
            meant = RENAMED_KEYS[key](value) if key in RENAMED_KEYS else {key: value}
            settings.update({name: known[name].check(item) for name, item in meant.items()})
        except ValueError as error:
            raise where.fail(f"{what}: {key}: {error}", start, key) from None
    # A path (``ds_config``) is the spec's: relative to the spec file, wherever matrix runs.
    return {
        name: where.path.parent / value
        if isinstance(value, pathlib.Path) and not value.is_absolute()
        else value
        for name, value in settings.items()
    }


def _axis_values(raw: Mapping[str, Any], axis: str, what: str, where, start) -> list[Any]:
    """The values of `axis` in a group or an exclude entry: a list, or one value."""
    if axis not in raw:
        return [AXES[axis].default]
    value = raw[axis]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise where.fail(f"{what}: {axis} is empty: give at least one value", start, axis)
    checked = []
    for item in values:
        try:
            checked.append(AXES[axis].check(item))
        except ValueError as error:
            raise where.fail(f"{what}: {axis}: {error}", start, axis) from None
    if len(set(checked)) != len(checked):
        raise where.fail(f"{what}: {axis}: a value repeats in {value!r}", start, axis)
    return checked


def _group(
    raw: Any, index: int, defaults: dict[str, Any], where: _Where
) -> tuple[list[Cell], list[Declared]]:
    """The cells of the `index`-th ``[[cells]]`` group, and those its excludes remove."""
    start = where.section("cells", index)
    what = f"[[cells]] #{index + 1}"
    group_keys = ("name", *AXES, *matrix_settings(), *RENAMED_KEYS, "exclude")
    _table(raw, what, group_keys, where, start)
    name = _text(raw.get("name"), what, where, start, "name")
    if not NAME_PATTERN.fullmatch(name):
        raise where.fail(
            f"{what}: name {name!r} is invalid: letters, digits, '.', '_', '+', '-' (at most "
            "64, starting with a letter or digit)",
            start,
            "name",
        )
    what = f"[[cells]] {name!r}"
    settings = tuple(sorted({**defaults, **_settings(raw, what, where, start)}.items()))
    values = [_axis_values(raw, axis, what, where, start) for axis in AXES]
    count = math.prod(len(axis_values) for axis_values in values)
    if count > MAX_CELLS:
        raise where.fail(f"{what}: {count:,} cells, more than {MAX_CELLS:,}", start)
    cells = [
        Cell(name, tuple(zip(AXES, combination, strict=True)), settings)
        for combination in itertools.product(*values)
    ]
    entries = raw.get("exclude", [])
    if not isinstance(entries, list):
        raise where.fail(f"{what}: exclude must be a list of tables", start, "exclude")
    declared: list[Declared] = []
    for number, entry in enumerate(entries):
        entry_start = where.exclude(index, number, start)
        cells, removed = _exclude(cells, entry, f"{what} exclude #{number + 1}", where, entry_start)
        declared += removed
    return cells, declared


def _exclude(
    cells: list[Cell], entry: Any, what: str, where: _Where, start: int | None
) -> tuple[list[Cell], list[Declared]]:
    _table(entry, what, EXCLUDE_KEYS, where, start)
    reason = _text(entry.get("reason"), what, where, start, "reason")
    axes = [axis for axis in AXES if axis in entry]
    if not axes:
        raise where.fail(f"{what}: names no axis, so it would exclude every cell", start)
    wanted = {axis: _axis_values(entry, axis, what, where, start) for axis in axes}
    kept, removed = [], []
    for cell in cells:
        matches = all(cell.value(axis) in wanted[axis] for axis in axes)
        (removed if matches else kept).append(cell)
    if not removed:
        raise where.fail(f"{what}: matches no cell of its group (a typo?)", start)
    return kept, [Declared(cell.id, reason, "excluded", cell.axes) for cell in removed]


def _scopes(raw: Any, where: _Where) -> list[Declared]:
    if not isinstance(raw, list):
        raise where.fail("out_of_scope must be a list of tables ([[out_of_scope]])")
    declared = []
    for index, entry in enumerate(raw):
        start = where.section("out_of_scope", index)
        what = f"[[out_of_scope]] #{index + 1}"
        _table(entry, what, SCOPE_KEYS, where, start)
        scope = _text(entry.get("scope"), what, where, start, "scope")
        reason = _text(entry.get("reason"), what, where, start, "reason")
        declared.append(Declared(scope, reason, "out of scope"))
    return declared


def _check_unique(cells: list[Cell], declared: list[Declared], where: _Where) -> None:
    seen: dict[str, str] = {}
    rows = [(cell.id, f"group {cell.group!r}") for cell in cells]
    rows += [(row.id, f"an {row.kind} row") for row in declared]
    for row_id, origin in rows:
        if row_id in seen:
            raise where.fail(
                f"cell {row_id!r} appears twice ({seen[row_id]} and {origin}): a cell's id is "
                "its axis values, so two cells must differ in at least one axis"
            )
        seen[row_id] = origin
