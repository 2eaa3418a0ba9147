"""A matrix's table: ``matrix.json`` (what ``compare`` and ``promote`` read) and ``matrix.md``.

One row per cell of the spec (qwz/qualify/matrix/matrix_spec.py), run or not: its axis values, its
status -- PASS, FAIL or INCONCLUSIVE from the cell's record (the record's own verdict,
re-derived when it is loaded), ``crashed`` (the cell's run ended without a record that
loads, or with an exit status ``run`` does not give), ``HARNESS-ERROR`` (the harness could
not observe the cell's subject: no verdict, [Note: harness errors] in
qualify/evidence/harness_error.py), or ``not run`` -- and why, the record's digest and the cell's
wall time. Nothing here runs a cell.

The matrix's exit status (``status_of``): 1 if any cell FAILed or crashed; else 4 if any
cell is a HARNESS-ERROR; else 3 if any
cell is INCONCLUSIVE, or if no cell has a verdict at all (a matrix that judged nothing is
not a pass); else 0. Cells that were not run (refused by ``run``, excluded by the spec, out
of scope) do not change it: the table says why each was not run.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from qwz import jsonio
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.evidence.harness_error import CANNOT_RUN, CANNOT_RUN_EXIT, HARNESS_ERROR_EXIT
from qwz.qualify.evidence.record import load as load_record
from qwz.qualify.evidence.schema import Record, RecordError

MATRIX_FORMAT = "qwz-matrix/1"
MATRIX_JSON = "matrix.json"
MATRIX_MD = "matrix.md"
VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")
CellStatus = Literal[
    "PASS", "FAIL", "INCONCLUSIVE", "HARNESS-ERROR", "CANNOT-RUN", "crashed", "not run"
]
CellKind = Literal[
    "ran",
    "resumed",
    "refused",
    "crashed",
    "harness-error",
    "cannot-run",
    "interrupted",
    "pending",
    "excluded",
    "out of scope",
]
AXIS_COLUMNS = (
    ("subject", "subject"),
    ("stage", "stage"),
    ("dtype", "dtype"),
    ("group_sizes", "G"),
    ("workload", "workload"),
    ("world_size", "W"),
    ("preset", "preset"),
    ("seed", "seed"),
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class MatrixCell(_Model):
    id: str
    group: str | None
    """The spec's cell group; None for a row the spec declares (excluded, out of scope)."""
    axes: dict[str, Any]
    status: CellStatus
    kind: CellKind
    """How the row came to be: ran now, resumed (a finished record kept), refused by
    ``run`` (exit 2), crashed, interrupted (the matrix was stopped before or while it ran),
    pending (not reached yet: the table of a matrix still running, or killed), excluded by
    the spec, or out of scope."""
    reason: str
    """Why it is not PASS: the failed or inconclusive checks, the refusal, the crash, the
    exclusion; empty for a PASS."""
    arguments: list[str]
    """The ``run`` arguments of the cell, without ``--out`` (empty for declared rows)."""
    record: str | None
    """The record's path relative to the matrix directory; None without a record."""
    digest: str | None
    wall_s: float | None
    """Seconds the cell's run took (None: not run, or resumed from a table without it)."""


class Matrix(_Model):
    format: Literal["qwz-matrix/1"] = MATRIX_FORMAT
    name: str
    description: str
    spec: str
    created_at: str
    wall_s: float
    """Seconds the matrix command ran (cells resumed from an earlier run cost nothing)."""
    cells: list[MatrixCell]

    def cell(self, cell_id: str) -> MatrixCell | None:
        return next((cell for cell in self.cells if cell.id == cell_id), None)


def status_of(cells: list[MatrixCell]) -> int:
    """The matrix's exit status (module docstring)."""
    statuses = {cell.status for cell in cells}
    if statuses & {"FAIL", "crashed"}:
        return 1
    if "HARNESS-ERROR" in statuses:
        return HARNESS_ERROR_EXIT
    if CANNOT_RUN in statuses:
        return CANNOT_RUN_EXIT
    if "INCONCLUSIVE" in statuses or not statuses & set(VERDICTS):
        return 3
    return 0


def is_matrix_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MATRIX_JSON).is_file()


def load_matrix(directory: pathlib.Path) -> Matrix:
    """The table in ``directory/matrix.json``; a RecordError naming the file otherwise."""
    path = pathlib.Path(directory) / MATRIX_JSON
    try:
        payload = jsonio.read_json_file(path, what="matrix table")
    except jsonio.JsonInputError as error:
        raise RecordError(str(error)) from None
    try:
        return Matrix.model_validate(payload)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(map(str, first["loc"])) or "(table)"
        raise RecordError(f"{path}: not a matrix table: {where}: {first['msg']}") from None


def cell_record(directory: pathlib.Path, cell: MatrixCell) -> Record | None:
    """The cell's record, loaded and verified (``record.load``); None where it has none."""
    return None if cell.record is None else load_record(pathlib.Path(directory) / cell.record)


def write(directory: pathlib.Path, matrix: Matrix) -> None:
    """``matrix.json`` and ``matrix.md`` in ``directory``, each atomically."""
    atomic_write_text(directory / MATRIX_JSON, matrix.model_dump_json(indent=2) + "\n")
    atomic_write_text(directory / MATRIX_MD, render_markdown(matrix))


def _axis_text(axes: dict[str, Any], axis: str) -> str:
    if axis not in axes:
        return "—"
    value = axes[axis]
    return "+".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "—"


def render_markdown(matrix: Matrix) -> str:
    counts: dict[str, int] = {}
    for cell in matrix.cells:
        counts[cell.status] = counts.get(cell.status, 0) + 1
    tally = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    lines = [
        f"# qwz qualification matrix: {matrix.name}",
        "",
        *([matrix.description, ""] if matrix.description else []),
        f"Spec `{matrix.spec}`, written {matrix.created_at}; {len(matrix.cells)} cells "
        f"({tally}); the matrix ran {matrix.wall_s:.1f} s; exit status "
        f"{status_of(matrix.cells)}.",
        "",
        "| cell | " + " | ".join(title for _, title in AXIS_COLUMNS) + " | status | why "
        "| record digest | wall |",
        "|---" * (len(AXIS_COLUMNS) + 5) + "|",
    ]
    for cell in matrix.cells:
        axes = " | ".join(_axis_text(cell.axes, axis) for axis, _ in AXIS_COLUMNS)
        digest = f"`{cell.digest[:12]}`" if cell.digest else "—"
        wall = f"{cell.wall_s:.1f} s" if cell.wall_s is not None else "—"
        status = cell.status if cell.kind != "resumed" else f"{cell.status} (resumed)"
        lines.append(
            f"| `{cell.id}` | {axes} | {status} | {_cell_text(cell.reason)} | {digest} | {wall} |"
        )
    return "\n".join(lines) + "\n"


def promote_matrix(matrix_dir: pathlib.Path, baseline_dir: pathlib.Path) -> Matrix:
    """Make a matrix that passed the baseline in ``baseline_dir``: every cell's record is
    promoted (qualify/review/history.py's ``promote``: passing, with a speed interval) into
    ``baseline_dir/cells/<id>/``, then the table is written there, last. A matrix with a
    FAIL, crashed or INCONCLUSIVE cell, or no cell with a record, is refused."""
    from qwz.qualify.review.history import promote

    matrix = load_matrix(matrix_dir)
    if status_of(matrix.cells) != 0:
        bad = [f"{cell.id} {cell.status}" for cell in matrix.cells if cell.status != "PASS"]
        bad = [item for item in bad if not item.endswith("not run")]
        raise RecordError(
            f"{matrix_dir}: a matrix that did not pass cannot become the baseline "
            f"({', '.join(bad) or 'no cell has a verdict'})"
        )
    cells = []
    for cell in matrix.cells:
        if cell.record is not None:
            target = baseline_dir / "cells" / cell.id
            if target.exists():
                shutil.rmtree(target)
            promote(matrix_dir / cell.record, target)
            cell = cell.model_copy(update={"record": f"cells/{cell.id}/record.json"})
        cells.append(cell)
    promoted = matrix.model_copy(update={"cells": cells})
    baseline_dir.mkdir(parents=True, exist_ok=True)
    write(baseline_dir, promoted)
    return promoted
