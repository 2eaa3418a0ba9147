"""No ratchet in the nightly gate (qwz/qualify/review/history.py, ci/nightly.sh): a fixed baseline
catches slow drift that night-to-night comparison never does; ``history`` renders the trend;
``promote`` is the only way a baseline changes."""

from __future__ import annotations

import pathlib

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import record, schema
from qwz.qualify.review import compare
from tests.unit.records import make_payload, make_performance, make_record

NIGHTS = 7
DRIFT_PER_NIGHT = 0.015
# Block noise of +-2%: a bootstrap interval about 4% wide, wider than one night's drift.
JITTER = (-0.02, 0.02, -0.01, 0.01)


def night_record(night: int) -> schema.Record:
    """Night 0 is the baseline; night n runs the candidate 1.5% slower than night n - 1."""
    performance = make_performance((1.0 - DRIFT_PER_NIGHT) ** night, JITTER)
    return make_record(
        performance=[performance], created_at=f"2025-06-{night + 1:02d}T02:17:00+00:00"
    )


def test_seven_nights_of_drift_fail_the_fixed_baseline_but_never_the_ratchet():
    records = [night_record(night) for night in range(NIGHTS + 1)]
    fixed = [compare.compare(records[0], records[n]).status for n in range(1, NIGHTS + 1)]
    ratchet = [compare.compare(records[n - 1], records[n]).status for n in range(1, NIGHTS + 1)]
    # Each night is within noise of the night before: the old gate passes every night ...
    assert set(ratchet) == {compare.Status.NO_REGRESSION}, ratchet
    # ... while against the fixed baseline the gate fails, and by the seventh night.
    assert fixed[-1] == compare.Status.REGRESSION, fixed
    first = fixed.index(compare.Status.REGRESSION) + 1
    assert first <= NIGHTS
    assert all(status == compare.Status.REGRESSION for status in fixed[first - 1 :]), fixed
    result = compare.compare(records[0], records[NIGHTS])
    assert any("speed-up of 'candidate-g64' fell" in line for line in result.lines)


def write_history(root: pathlib.Path) -> pathlib.Path:
    directory = root / "history"
    for night in range(NIGHTS + 1):
        out = directory / f"2025-06-{night + 1:02d}" / "stage2"
        out.mkdir(parents=True)
        record.save(night_record(night), out / "record.json")
    return directory


def test_history_renders_one_row_per_night_and_one_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QWZ_RECORD_KEY", raising=False)
    monkeypatch.delenv("QWZ_RECORD_KEY_FILE", raising=False)
    directory = write_history(tmp_path)
    out = tmp_path / "trend"
    assert cli.main(["history", str(directory), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| 2025-06-")]
    assert len(rows) == NIGHTS + 1
    assert rows[0].startswith("| 2025-06-01 ") and rows[-1].startswith("| 2025-06-08 ")
    assert "| 2 | candidate-g64 |" in rows[0] and "| PASS | unsigned |" in rows[0]
    medians = [float(row.split("|")[4].strip().rstrip("x")) for row in rows]
    assert medians == sorted(medians, reverse=True)  # the drift is visible
    assert (out / "history.md").read_text() == text
    assert (out / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![speed-up and final loss per night](history.png)" in text
    assert not [path for path in out.iterdir() if path.name.startswith(".")]


def test_history_lists_a_record_it_cannot_load_and_exits_2(tmp_path, capsys):
    directory = write_history(tmp_path)
    broken = directory / "2025-06-03" / "stage2" / "record.json"
    broken.write_text(broken.read_text()[:100])
    assert cli.main(["history", str(directory)]) == 2
    text = capsys.readouterr().out
    assert f"- {broken}: not valid JSON" in text
    assert len([line for line in text.splitlines() if line.startswith("| 2025-06-")]) == NIGHTS


def test_history_of_a_missing_directory(tmp_path, capsys):
    assert cli.main(["history", str(tmp_path / "absent")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_promote_copies_a_passing_record(tmp_path, capsys):
    source = tmp_path / "night" / "record.json"
    source.parent.mkdir()
    record.save(make_record(), source)
    (source.parent / "report.md").write_text("# report\n")
    baseline = tmp_path / "baseline" / "stage2"
    assert cli.main(["promote", str(source), str(baseline)]) == 0
    assert record.load(baseline / "record.json") == record.load(source)
    assert (baseline / "report.md").read_text() == "# report\n"
    assert "promoted" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["failing", "corrupt"])
def test_promote_refuses_a_failing_or_corrupt_record(tmp_path, capsys, kind):
    source = tmp_path / "record.json"
    if kind == "failing":
        updates = make_payload()["updates"]
        updates[2]["violations"] = 4
        record.save(make_record(updates=updates), source)
    else:
        source.write_text("{")
    baseline = tmp_path / "baseline"
    assert cli.main(["promote", str(source), str(baseline)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qwz-qualify promote: error: {source}: ")
    assert "cannot become the baseline" in err if kind == "failing" else "not valid JSON" in err
    assert not (baseline / "record.json").exists()


def test_nightly_script_never_copies_a_night_into_the_baseline():
    """The ratchet was `cp "$out"/* "$root/qualified/..."` after every passing night; the
    baseline now changes only through `qwz-qualify promote`, on request."""
    script = (pathlib.Path(__file__).parents[4] / "ci" / "nightly.sh").read_text()
    assert "cp " not in script
    assert script.count("promote") >= 2 and "QWZ_PROMOTE" in script
    assert "history" in script and "--require-signature" in script
