"""Every ``qwz-qualify`` command speaks one way (issue 49; [Note: one error style] in
qwz/qualify/cli_parser.py): errors as ``qwz-qualify COMMAND: error: ...`` on stderr with exit
2 and no traceback, no abbreviated flags, "did you mean" for a misspelt one, help for every
argument with its default, ``--version``, and the exit-status table in every ``--help``."""

from __future__ import annotations

import argparse
import errno
import json
import os
import pathlib
import subprocess
import sys

import pytest

from qwz import __version__
from qwz.qualify import cli
from qwz.qualify.base import exit_codes, files
from qwz.qualify.evidence import record

from ..records import make_record

COMMANDS = ["run", "matrix", "report", "compare", "history", "promote", "bisect", "bisect-step",
            "review"]  # fmt: skip


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def test_every_command_is_listed_here():
    assert sorted(command_parsers()) == sorted(COMMANDS)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"qwz-qualify {__version__}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_ends_with_the_one_exit_status_table(command):
    text = command_parsers()[command].format_help()
    if command == "bisect-step":
        assert "0 good, 1 bad, 125 skip, 128 abort (git bisect run's protocol)" in text
        return
    assert "exit status, the same for every qwz-qualify command:" in text
    for code, meaning in exit_codes.MEANINGS.items():
        assert f"  {code:<4} {meaning}" in text, (code, text[-2000:])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_argument_has_help_and_shows_its_default(command):
    """A positional says what it is; an option not required says its default."""
    parser = command_parsers()[command]
    formatter = parser.formatter_class(prog=parser.prog)
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if not action.help:
            missing.append(f"{action.dest}: no help")
            continue
        shown = formatter._expand_help(action)
        if action.option_strings and not action.required and "default" not in shown:
            missing.append(f"{action.option_strings[0]}: no default in {shown!r}")
    assert not missing, missing


def usage_error(capsys, argv: list[str], code: int = 2) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_misspelt_flag_is_refused_naming_the_flag_it_resembles(capsys):
    last = usage_error(capsys, ["run", "--out", "x", "--worklaod", "mlp"])
    assert last == (
        "qwz-qualify run: error: unrecognized arguments: --worklaod mlp "
        "(--worklaod: did you mean --workload?)"
    )
    last = usage_error(capsys, ["compare", "a", "b", "--memory-grwoth-pct", "5"])
    assert last.startswith("qwz-qualify compare: error: unrecognized arguments")
    assert "did you mean --memory-growth-pct?" in last


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--out", "x", "--work", "mlp"],
        ["run", "--ou", "x"],
        ["compare", "a", "b", "--memory", "5"],
        ["history", "d", "--fo", "junit"],
    ],
)
def test_no_flag_is_taken_by_a_prefix(capsys, argv):
    last = usage_error(capsys, argv)
    assert f"qwz-qualify {argv[0]}: error: " in last


def test_bisect_refuses_abbreviated_out_and_force_after_the_separator(tmp_path, capsys):
    """``--ou DIR --forc`` slipped past the check that refuses ``--out``/``--force`` after
    ``--``: argparse took them as ``--out DIR --force`` for every trial."""
    out, elsewhere = str(tmp_path / "bisect"), str(tmp_path / "elsewhere")
    argv = ["bisect", "--repo", str(tmp_path), "--good", "a", "--bad", "b", "--out", out,
            "--", "--ou", elsewhere, "--forc"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --ou" in err and "did you mean --out?" in err
    assert not (tmp_path / "bisect").exists()
    argv[argv.index("--ou")] = "--out"
    assert cli.main(argv) == 2
    assert "--out is the bisect's to set, not a run argument" in capsys.readouterr().err


def test_bisect_step_refuses_with_git_bisects_abort(capsys):
    """git reads 2 as "bad": a usage error of the step must abort the bisect (128)."""
    usage_error(capsys, ["bisect-step", "--good", "a"], code=exit_codes.GIT_BISECT_ABORT)


def saved(path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    record.save(make_record(), path)
    return path


def refused(capsys, argv: list[str]) -> str:
    """`argv` exits 2 with one ``qwz-qualify COMMAND: error:`` line on stderr, nothing on
    stdout, no traceback; that line."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qwz-qualify {argv[0]}: error: "), lines
    return lines[0]


def test_record_commands_refuse_in_one_style(tmp_path, capsys):
    good = saved(tmp_path / "run" / "record.json")
    (tmp_path / "file").write_text("x")
    missing = tmp_path / "missing.json"
    assert refused(capsys, ["report", str(missing)]).startswith(
        f"qwz-qualify report: error: {missing}"
    )
    refused(capsys, ["compare", str(missing), str(good)])
    refused(capsys, ["history", str(tmp_path / "file")])
    assert refused(capsys, ["history", str(tmp_path), "--out", str(tmp_path / "file")]).endswith(
        f"--out {tmp_path / 'file'}: exists and is not a directory"
    )
    assert refused(capsys, ["promote", str(good), str(tmp_path / "file")]).endswith(
        f"BASELINE_DIR {tmp_path / 'file'}: exists and is not a directory"
    )


def test_history_and_promote_refuse_a_directory_they_cannot_write(tmp_path, capsys, monkeypatch):
    """Root writes into a read-only directory anyway, so ask os.access, as run's preflight does."""
    good = saved(tmp_path / "run" / "record.json")
    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(files.os, "access", lambda *args, **kwargs: False)
    line = refused(capsys, ["history", str(tmp_path), "--out", str(tmp_path / "locked")])
    assert line.endswith("the directory is not writable")
    line = refused(capsys, ["promote", str(good), str(tmp_path / "locked")])
    assert line.endswith("the directory is not writable")
    assert not (tmp_path / "locked" / "record.json").exists()


def test_a_file_system_error_mid_command_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    saved(tmp_path / "run" / "record.json")

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(cli, "atomic_write_text", read_only)
    line = refused(capsys, ["history", str(tmp_path), "--out", str(tmp_path / "trend")])
    assert line == (
        f"qwz-qualify history: error: {tmp_path / 'trend' / 'history.md'}: read-only file system"
    )


def test_a_bug_of_the_harness_is_exit_4_never_the_subjects(capsys, monkeypatch, tmp_path):
    def bug(args):
        raise KeyError("arm names repeat")

    monkeypatch.setitem(cli.HANDLERS, "report", bug)
    assert cli.main(["report", str(tmp_path)]) == exit_codes.HARNESS_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == (
        "qwz-qualify report: HARNESS-ERROR: a bug in qwz-qualify (the traceback above), not a "
        "verdict on the subject"
    )


class _ClosedPipe:
    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_a_closed_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    path = saved(tmp_path / "record.json")
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert cli.main(["report", str(path)]) == exit_codes.OUTPUT_CLOSED
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


def test_report_into_a_closed_pipe_prints_nothing_on_stderr(tmp_path):
    """``qwz-qualify report ... | head -1``: the reader is gone before the report is written;
    no traceback, not even the interpreter's own at its last flush."""
    path = saved(tmp_path / "record.json")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "qwz.qualify", "report", str(path)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (exit_codes.OUTPUT_CLOSED, "")


def test_record_commands_take_the_run_directory(tmp_path, capsys):
    """``report`` and ``compare`` refused the directory that ``run --out`` named."""
    run = saved(tmp_path / "run" / "record.json").parent
    assert cli.main(["report", str(run)]) == 0
    assert "# qwz qualification" in capsys.readouterr().out
    assert cli.main(["compare", str(run), str(run)]) == 0
    assert cli.main(["promote", str(run), str(tmp_path / "baseline")]) == 0
    assert "promoted" in capsys.readouterr().out
    promoted = (tmp_path / "baseline" / "record.json").read_bytes()
    assert promoted == (run / "record.json").read_bytes()


def test_promote_replaces_a_baseline_only_with_force(tmp_path, capsys):
    first = saved(tmp_path / "first" / "record.json")
    second = tmp_path / "second" / "record.json"
    second.parent.mkdir()
    payload = json.loads(first.read_text())
    record.save(make_record(created_at="2025-06-03T14:31:07+00:00"), second)
    assert json.loads(second.read_text())["created_at"] != payload["created_at"]
    baseline = tmp_path / "baseline"
    assert cli.main(["promote", str(first), str(baseline)]) == 0
    capsys.readouterr()
    line = refused(capsys, ["promote", str(second), str(baseline)])
    assert line.endswith(
        f"{baseline}: already holds a baseline; pass --force to replace it (the nightly's "
        "gate compares with it), or choose another directory"
    )
    assert (baseline / "record.json").read_bytes() == first.read_bytes()
    assert cli.main(["promote", str(second), str(baseline), "--force"]) == 0
    assert (baseline / "record.json").read_bytes() == second.read_bytes()
