"""A run's directory keeps every result (issue 49; [Note: results kept] in
qwz/qualify/evidence/run_dir.py): ``--keep-previous`` moves the earlier run aside, ``--force``
leaves no file of the earlier run beside the new one, and a directory whose run left no
record is never read as a verdict."""

from __future__ import annotations

import pathlib

import pytest

from qwz.qualify.evidence import record, run_dir
from qwz.qualify.evidence.schema import RecordError
from qwz.qualify.review import plots, run_files
from tests.unit.records import make_payload, make_record


def a_run(out: pathlib.Path, label: str) -> pathlib.Path:
    out.mkdir(parents=True)
    (out / "report.md").write_text(label)
    return out


def test_keep_previous_moves_the_earlier_runs_up_and_drops_the_oldest(tmp_path):
    out = tmp_path / "cpu-qualify"
    for label in ("first", "second", "third"):
        run_dir.keep_previous(out, 2)
        a_run(out, label)
    kept = {path.name: (path / "report.md").read_text() for path in tmp_path.iterdir()}
    assert kept == {"cpu-qualify": "third", "cpu-qualify.1": "second", "cpu-qualify.2": "first"}
    assert run_dir.keep_previous(out, 2) == [
        f"removed {tmp_path / 'cpu-qualify.2'}, the oldest run kept (--keep-previous 2)",
        f"moved the previous run in {out} to {tmp_path / 'cpu-qualify.1'}",
    ]
    kept = {path.name: (path / "report.md").read_text() for path in tmp_path.iterdir()}
    assert kept == {"cpu-qualify.1": "third", "cpu-qualify.2": "second"}


def test_keep_previous_leaves_a_directory_without_a_run(tmp_path):
    out = tmp_path / "out"
    assert run_dir.keep_previous(out, 3) == []
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    assert run_dir.keep_previous(out, 3) == [] and (out / "notes.txt").exists()
    with pytest.raises(ValueError, match="at least 1"):
        run_dir.keep_previous(out, 0)


def test_the_plot_names_are_every_plot_a_run_draws(tmp_path):
    """run_dir.PLOT_FILES is what --force removes: a plot it does not name would survive."""
    drawn = plots.write_plots(make_record(), tmp_path)
    assert set(drawn.values()) <= set(run_dir.PLOT_FILES), drawn
    assert {path.name for path in tmp_path.iterdir()} == set(drawn.values())


def test_force_leaves_no_file_of_the_earlier_run(tmp_path, capsys):
    """Before: the earlier run's plots (and a timed-out.json) stayed beside the new record."""
    out = tmp_path / "out"
    out.mkdir()
    for name in run_dir.RUN_FILES:
        (out / name).write_text("the earlier run's")
    (out / "notes.txt").write_text("the user's")
    no_speed_blocks = make_record(performance=[])
    assert run_files.write_evidence(no_speed_blocks, out) == 0
    written = sorted(path.name for path in out.iterdir())
    assert "speedup.png" not in written and "timed-out.json" not in written, written
    assert set(written) == {"record.json", "report.md", "loss.png", "held_out.png", "notes.txt"}
    assert record.load(out).digest == no_speed_blocks.digest
    assert "and 2 plots; PASS" in capsys.readouterr().out


def test_remove_stale_removes_only_a_runs_files(tmp_path):
    for name in (*run_dir.RUN_FILES, "notes.txt"):
        (tmp_path / name).write_text("x")
    removed = run_dir.remove_stale(tmp_path, ["timed-out.json"])
    assert set(removed) == set(run_dir.RUN_FILES) - {"timed-out.json"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "timed-out.json"]


@pytest.mark.parametrize(
    ("left", "content", "said"),
    [
        ("timed-out.json", '{"verdict": "TIMED-OUT", "why": "the run\'s time limit ran out"}',
         "its run left no record: TIMED-OUT: the run's time limit ran out"),
        ("interrupted.json", '{"verdict": null, "why": "interrupted by SIGINT while x"}',
         "its run left no record: INTERRUPTED (no verdict): interrupted by SIGINT while x"),
        ("harness-error.json", '{"verdict": "HARNESS-ERROR", "needed": "offsets"}',
         "its run left no record: HARNESS-ERROR: the harness could not observe"),
        ("notes.txt", "x", "a directory without a record.json (not a run's --out)"),
    ],
)  # fmt: skip
def test_a_run_directory_without_a_record_is_refused_naming_why(tmp_path, left, content, said):
    (tmp_path / left).write_text(content)
    with pytest.raises(RecordError) as error:
        record.load(tmp_path)
    assert str(error.value).startswith(f"{tmp_path}: {said}")


def test_a_run_directory_reads_as_its_record(tmp_path):
    record.save(make_record(), tmp_path / "record.json")
    assert run_dir.record_in(tmp_path) == tmp_path / "record.json"
    assert record.load(tmp_path).digest == record.load(tmp_path / "record.json").digest
    assert make_payload()["schema_version"] == record.load(tmp_path).schema_version
