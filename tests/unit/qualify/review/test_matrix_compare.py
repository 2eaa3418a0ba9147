"""``compare`` and ``promote`` of matrix directories (qualify/review/matrix_compare.py and
matrix.py's ``promote_matrix``): cell by cell, lost and new cells, through the CLI too."""

from __future__ import annotations

import pathlib

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import record as record_io
from qwz.qualify.evidence import schema, seal
from qwz.qualify.review import matrix as table
from qwz.qualify.review.compare import Status
from qwz.qualify.review.matrix_compare import compare_matrices
from tests.unit.records import make_payload


def fail_updates(payload):
    payload["updates"][2]["violations"] = 3


def write_matrix(directory: pathlib.Path, cells: dict[str, object]) -> pathlib.Path:
    """A matrix directory: per cell id, a payload edit (a record is written) or a reason
    (the cell was not run)."""
    rows = []
    for cell_id, outcome in cells.items():
        if isinstance(outcome, str):
            rows.append(_row(cell_id, "not run", outcome, None, None))
            continue
        payload = make_payload()
        if outcome is not None:
            outcome(payload)
        built = seal.seal(payload)
        path = directory / "cells" / cell_id / "record.json"
        path.parent.mkdir(parents=True)
        record_io.save(built, path)
        relative = f"cells/{cell_id}/record.json"
        rows.append(_row(cell_id, built.verdict.status, "", relative, built.digest))
    matrix = table.Matrix(
        name="m", description="", spec="spec.toml", created_at="now", wall_s=1.0, cells=rows
    )
    directory.mkdir(parents=True, exist_ok=True)
    table.write(directory, matrix)
    return directory


def _row(cell_id, status, reason, record, digest) -> table.MatrixCell:
    return table.MatrixCell(
        id=cell_id,
        group="g",
        axes={"stage": 2},
        status=status,
        kind="refused" if status == "not run" else "ran",
        reason=reason,
        arguments=[],
        record=record,
        digest=digest,
        wall_s=None if record is None else 2.5,
    )


def regressions(result) -> list[str]:
    return [line for line in result.lines if line.startswith("REGRESSION: ")]


def test_identical_matrices_do_not_regress(tmp_path):
    base = write_matrix(tmp_path / "base", {"a": None, "b": None, "c": "refused"})
    head = write_matrix(tmp_path / "head", {"a": None, "b": None, "c": "refused"})
    result = compare_matrices(base, head)
    assert result.status == Status.NO_REGRESSION, result.text()
    assert "cell a: result: no regression" in result.lines
    assert any(line.startswith("cell c: not run in either") for line in result.lines)
    assert result.lines[-1] == (
        "result: no regression (2 compared without regression, 1 without a record on either side)"
    )


def test_a_cell_that_regressed_fails_the_gate_and_is_named(tmp_path):
    base = write_matrix(tmp_path / "base", {"a": None, "b": None})
    head = write_matrix(tmp_path / "head", {"a": None, "b": fail_updates})
    result = compare_matrices(base, head)
    assert result.status == Status.REGRESSION
    [line] = regressions(result)
    assert line.startswith("REGRESSION: cell b: check 'update[candidate-g64]' was pass")


def test_a_cell_lost_in_the_candidate_is_a_regression_and_a_new_one_is_reported(tmp_path):
    base = write_matrix(tmp_path / "base", {"a": None, "b": None})
    head = write_matrix(tmp_path / "head", {"a": None, "b": "refused by run: no", "n": None})
    result = compare_matrices(base, head)
    assert result.status == Status.REGRESSION
    [line] = regressions(result)
    assert "cell b: lost: the baseline has a PASS record" in line and "refused by run" in line
    assert any(
        line.startswith("cell n: new: the candidate's record (PASS)") for line in result.lines
    )
    gone = write_matrix(tmp_path / "gone", {"a": None})
    [line] = regressions(compare_matrices(base, gone))
    assert "cell b: lost" in line and "absent from its spec" in line


def test_matrices_without_a_shared_cell_or_a_table_are_not_comparable(tmp_path):
    base = write_matrix(tmp_path / "base", {"a": None})
    other = write_matrix(tmp_path / "other", {"z": None})
    assert compare_matrices(base, other).status == Status.NOT_COMPARABLE
    (tmp_path / "empty").mkdir()
    result = compare_matrices(base, tmp_path / "empty")
    assert result.status == Status.NOT_COMPARABLE and "matrix.json" in result.text()


def test_compare_and_promote_on_the_command_line(tmp_path, capsys):
    base = write_matrix(tmp_path / "base", {"a": None})
    good = write_matrix(tmp_path / "good", {"a": None})
    bad = write_matrix(tmp_path / "bad", {"a": fail_updates})
    assert cli.main(["compare", str(base), str(good)]) == 0
    assert cli.main(["compare", str(base), str(bad)]) == 1
    assert "REGRESSION: cell a:" in capsys.readouterr().out
    assert cli.main(["compare", str(base), str(base / "cells" / "a" / "record.json")]) == 2
    assert cli.main(["promote", str(bad), str(tmp_path / "baseline")]) == 2
    assert "a matrix that did not pass cannot become the baseline (a FAIL)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "baseline").exists()
    assert cli.main(["promote", str(good), str(tmp_path / "baseline")]) == 0
    promoted = table.load_matrix(tmp_path / "baseline")
    assert promoted.cells[0].record == "cells/a/record.json"
    assert table.cell_record(tmp_path / "baseline", promoted.cells[0]).digest == (
        table.cell_record(good, table.load_matrix(good).cells[0]).digest
    )
    assert cli.main(["compare", str(tmp_path / "baseline"), str(good)]) == 0


def test_a_table_that_does_not_validate_is_refused(tmp_path):
    directory = write_matrix(tmp_path / "m", {"a": None})
    path = directory / "matrix.json"
    path.write_text(path.read_text().replace('"status": "PASS"', '"status": "GREAT"'))
    with pytest.raises(schema.RecordError, match=r"not a matrix table: cells\.0\.status"):
        table.load_matrix(directory)
