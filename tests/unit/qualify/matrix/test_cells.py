"""Running a matrix (qwz/qualify/matrix/cells.py) through a fake ``run``: which cells are
launched ([Note: matrix resume]), how each end reads, the exit status, and stopping."""

from __future__ import annotations

import json
import pathlib
import signal
import textwrap

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import record as record_io
from qwz.qualify.evidence import seal
from qwz.qualify.matrix import cells
from qwz.qualify.matrix.matrix_spec import load
from qwz.qualify.review import matrix as table
from tests.unit.records import make_payload

PARSER = cli.build_parser()
SPEC = """
[matrix]
name = "unit"
[defaults]
steps = {steps}
blocks = 2
[[cells]]
name = "g"
workload = "mlp"
stage = [1, 2]
[[out_of_scope]]
scope = "offload"
reason = "offload: not supported by the quantized gather"
"""


def write_spec(tmp_path: pathlib.Path, steps: int = 6) -> pathlib.Path:
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(SPEC.format(steps=steps)))
    return path


class FakeRun:
    """Stands in for ``python -m qwz.qualify run``: counts launches and, per stage, writes a
    record of the plan the arguments ask for (or not) and returns an exit status."""

    def __init__(self, outcomes: dict[str, tuple] | None = None) -> None:
        self.launched: list[list[str]] = []
        self.outcomes = outcomes or {}

    def __call__(self, argv: list[str], logs: cells.CellLogs, stop: cells.Stop) -> int:
        self.launched.append(argv)
        out = pathlib.Path(argv[argv.index("--out") + 1])
        stage = argv[argv.index("--stage") + 1]
        code, stderr, edit = self.outcomes.get(stage, (0, "", None))
        logs.stderr.write_text(stderr)
        if code in (0, 1, 3):
            plan = cells.expected_plan(PARSER, argv[1 : argv.index("--out")])
            payload = make_payload(plan=plan)
            if edit is not None:
                edit(payload)
            out.mkdir(parents=True, exist_ok=True)
            record_io.save(seal.seal(payload), out / "record.json")
        return code


def run(tmp_path: pathlib.Path, fake: FakeRun, spec: pathlib.Path | None = None) -> int:
    spec_path = spec or write_spec(tmp_path)
    matrix = cells.MatrixRun(load(spec_path), tmp_path / "out", PARSER, launch=fake)
    return cells.run_matrix(matrix, progress=lambda line: None)


def rows(tmp_path: pathlib.Path) -> dict[str, table.MatrixCell]:
    return {cell.id: cell for cell in table.load_matrix(tmp_path / "out").cells}


S1 = "qwz-s1-bf16-g64-mlp-w2-default-seed0"
S2 = "qwz-s2-bf16-g64-mlp-w2-default-seed0"


def fail_updates(payload):
    payload["updates"][2]["violations"] = 3


def test_every_cell_runs_once_and_a_finished_cell_is_not_run_again(tmp_path):
    fake = FakeRun()
    assert run(tmp_path, fake) == 0
    assert len(fake.launched) == 2
    first = rows(tmp_path)
    assert [first[S1].status, first[S1].kind, first["offload"].status] == ["PASS", "ran", "not run"]
    assert first[S1].digest and first[S1].wall_s is not None
    again = FakeRun()
    assert run(tmp_path, again) == 0
    assert again.launched == [], "a finished cell was run again"
    second = rows(tmp_path)
    assert second[S1].kind == "resumed" and second[S1].digest == first[S1].digest
    assert second[S1].wall_s == first[S1].wall_s  # carried from the earlier table


def test_a_record_of_another_plan_is_run_again(tmp_path):
    """The spec changed (steps 6 -> 7): both records are of another plan now."""
    assert run(tmp_path, FakeRun()) == 0
    again = FakeRun()
    assert run(tmp_path, again, write_spec(tmp_path, steps=7)) == 0
    assert len(again.launched) == 2
    assert {row.kind for row in rows(tmp_path).values() if row.group} == {"ran"}
    assert all("--force" in argv for argv in again.launched)


def test_a_record_that_does_not_verify_is_run_again(tmp_path):
    assert run(tmp_path, FakeRun()) == 0
    path = tmp_path / "out" / "cells" / S1 / "record.json"
    payload = json.loads(path.read_text())
    payload["created_at"] = "2030-01-01T00:00:00+00:00"  # the digest no longer matches
    path.write_text(json.dumps(payload))
    again = FakeRun()
    assert run(tmp_path, again) == 0
    assert [argv[argv.index("--stage") + 1] for argv in again.launched] == ["1"]


def test_the_finished_check_compares_the_plan_and_the_world_size(tmp_path):
    arguments = ["--workload", "mlp", "--steps", "6"]
    plan = cells.expected_plan(PARSER, arguments)
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    record_io.save(seal.seal(make_payload(plan=plan)), cell_dir / "record.json")
    assert cells.finished_record(cell_dir, plan, 2)[0] is not None
    other = cells.expected_plan(PARSER, [*arguments, "--lr", "0.002"])
    assert cells.finished_record(cell_dir, other, 2) == (
        None,
        "its record has another plan (differs in lr)",
    )
    assert "ran 2 ranks, not 4" in cells.finished_record(cell_dir, plan, 4)[1]
    assert cells.expected_plan(PARSER, ["--dtype", "fp8"]) is None


def test_a_refused_cell_is_not_run_with_the_reason_and_runs_again_next_time(tmp_path):
    stderr = (
        "usage: qwz-qualify run [-h] ...\n"
        "qwz-qualify run: error: argument --dtype: invalid choice: 'fp16'\n"
    )
    fake = FakeRun({"1": (2, stderr, None)})
    assert run(tmp_path, fake) == 0  # the cell that ran passed
    refused = rows(tmp_path)[S1]
    assert (refused.status, refused.kind, refused.record) == ("not run", "refused", None)
    assert refused.reason == "refused by run: argument --dtype: invalid choice: 'fp16'"
    again = FakeRun()
    assert run(tmp_path, again) == 0
    assert len(again.launched) == 1 and rows(tmp_path)[S1].status == "PASS"


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (-9, "run was killed by SIGKILL"),
        (70, "run exited 70, which run never gives"),
    ],
)
def test_a_crashed_cell_is_recorded_as_crashed_and_fails_the_matrix(tmp_path, code, why):
    fake = FakeRun({"2": (code, "Traceback ...\nRuntimeError: boom\n", None)})
    assert run(tmp_path, fake) == 1
    crashed = rows(tmp_path)[S2]
    assert (crashed.status, crashed.kind) == ("crashed", "crashed")
    assert why in crashed.reason and "RuntimeError: boom" in crashed.reason


def test_a_verdict_exit_without_a_record_of_the_cell_is_a_crash(tmp_path):
    def no_record(argv, logs, stop):
        return 0

    matrix = cells.MatrixRun(load(write_spec(tmp_path)), tmp_path / "out", PARSER, launch=no_record)
    assert cells.run_matrix(matrix, progress=lambda line: None) == 1
    assert rows(tmp_path)[S1].reason == "run exited 0 (PASS) but no record"


def test_a_failing_cell_fails_the_matrix_and_says_which_check(tmp_path):
    assert run(tmp_path, FakeRun({"2": (1, "", fail_updates)})) == 1
    failed = rows(tmp_path)[S2]
    assert failed.status == "FAIL" and failed.reason.startswith("update[candidate-g64]: ")


def test_a_matrix_where_nothing_has_a_verdict_is_not_a_pass(tmp_path):
    refused = (2, "qwz-qualify run: error: no\n", None)
    assert run(tmp_path, FakeRun({"1": refused, "2": refused})) == 3


def test_status_of_the_table():
    def cell(status):
        kind = {"not run": "refused", "crashed": "crashed"}.get(status, "ran")
        return table.MatrixCell(
            id=status, group="g", axes={}, status=status, kind=kind, reason="",
            arguments=[], record=None, digest=None, wall_s=None,
        )  # fmt: skip

    assert table.status_of([cell("PASS"), cell("not run")]) == 0
    assert table.status_of([cell("PASS"), cell("INCONCLUSIVE")]) == 3
    assert table.status_of([cell("INCONCLUSIVE"), cell("FAIL")]) == 1
    assert table.status_of([cell("PASS"), cell("crashed")]) == 1
    assert table.status_of([cell("not run")]) == 3


def test_a_stop_forwards_the_signal_keeps_finished_cells_and_marks_the_rest(tmp_path):
    """SIGTERM while the second of three cells runs: the first cell's record is kept, the
    second and third are not run, the exit status is 143; the next run runs only those."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(steps=6).replace("stage = [1, 2]", "seed = [0, 1, 2]"))

    class Stopped(FakeRun):
        def __call__(self, argv, logs, stop):
            if len(self.launched) == 1:
                self.launched.append(argv)
                stop.handle(signal.SIGTERM, None)  # what the handler does on a signal
                return 143  # run's exit when stopped: no record
            return super().__call__(argv, logs, stop)

    assert run(tmp_path, Stopped(), spec) == 143
    table_rows = [row for row in table.load_matrix(tmp_path / "out").cells if row.group]
    assert [(row.status, row.kind) for row in table_rows] == [
        ("PASS", "ran"),
        ("not run", "interrupted"),
        ("not run", "interrupted"),
    ]
    assert "stopped by SIGTERM while this cell ran" in table_rows[1].reason
    assert "not reached" in table_rows[2].reason
    again = FakeRun()
    assert run(tmp_path, again, spec) == 0
    assert [argv[argv.index("--seed") + 1] for argv in again.launched] == ["1", "2"]


def test_the_markdown_names_every_cell_its_status_why_digest_and_wall_time(tmp_path):
    assert run(tmp_path, FakeRun({"2": (1, "", fail_updates)})) == 1
    text = (tmp_path / "out" / "matrix.md").read_text()
    loaded = table.load_matrix(tmp_path / "out")
    for row in loaded.cells:
        line = next(line for line in text.splitlines() if f"`{row.id}`" in line)
        assert f"| {row.status} |" in line
        if row.digest:
            assert row.digest[:12] in line and f"{row.wall_s:.1f} s" in line
    assert "offload: not supported by the quantized gather" in text
    assert "exit status 1" in text and "the matrix ran" in text
