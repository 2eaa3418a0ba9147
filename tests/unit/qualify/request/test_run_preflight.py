"""``qwz-qualify run`` refuses what it cannot do before any rank starts, writes atomically,
and turns SIGINT/SIGTERM into exit 130/143 (issue 9, "run fails fast and cleans up"); what
is knowable before a rank starts is refused then, and a run that ends on its time limit or a
signal says so in its own file (issue 49).

No training here: flags go through ``build_parser``, ``run_request.resolve`` and
``preflight.problems`` (the
``mlp`` workload, counted on the meta device); ``launch`` is replaced where ``cmd_run``
must get past the checks. The real SIGTERM of a running ``run`` is in
``tests/multigpu/test_run_signals.py``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import pathlib
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwz.qualify import cli
from qwz.qualify.base import files
from qwz.qualify.base.rank_reports import RankEnd
from qwz.qualify.evidence import ledger
from qwz.qualify.request import preflight, run_request
from qwz.qualify.run import launch
from tests.extras import NEEDS_TRANSFORMERS
from tests.unit.run_requests import plan_of, problems_of


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["run", *argv])


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("qwz-qualify run: error: ") and "Traceback" not in err
    return last


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "nan"], "argument --lr: nan is invalid: must be a finite number > 0"),
        (["--lr", "inf"], "argument --lr: inf is invalid: must be a finite number > 0"),
        (["--lr=-1e-3"], "argument --lr: -1e-3 is invalid: must be a finite number > 0"),
        (["--lr", "0"], "argument --lr: 0 is invalid"),
        (["--lr", "fast"], "argument --lr: 'fast' is not a number"),
        (["--timeout", "0"], "argument --timeout: 0 is invalid: must be a finite number > 0"),
        (["--timeout", "-5"], "argument --timeout: -5 is invalid"),
        (["--timeout", "nan"], "argument --timeout: nan is invalid"),
        (["--steps", "ten"], "argument --steps: 'ten' is not an integer"),
        (["--steps", "0"], "argument --steps: 0 is invalid: must be a positive integer"),
        (["--world-size", "2.5"], "argument --world-size: '2.5' is not an integer"),
        (["--world-size", "9" * 5000], "argument --world-size: '999"),
        (["--warmup-steps", "-1"], "argument --warmup-steps: -1 is invalid: must be an integer"),
        (["--group-size", "abc"], "argument --group-size: 'abc' is not an integer"),
        (["--group-size", "12"], "argument --group-size: 12 is invalid: must be a positive multi"),
        (["--seed", "-1"], "argument --seed: -1 is invalid"),
        (["--stage", "3"], "argument --stage: 3 is invalid: must be ZeRO stage 1 or 2"),
        (["--stage", "1e3"], "argument --stage: '1e3' is not an integer"),
        (["--min-speedup", "nan"], "argument --min-speedup: nan is invalid: must be a finite"),
        (["--out", ""], "argument --out: '' is not a usable path"),
    ],
)
def test_bad_flag_values_are_usage_errors_naming_the_flag(capsys, argv, message):
    argv = argv if "--out" in argv else ["--out", "somewhere", *argv]
    last = usage_error(capsys, *argv)
    assert message in last
    assert "invalid literal" not in last and len(last) < 300


def test_compare_memory_growth_must_be_finite(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["compare", "a", "b", "--memory-growth-pct", "inf"])
    assert exit_info.value.code == 2
    assert "--memory-growth-pct: inf is invalid" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# the request's problems
# --------------------------------------------------------------------------- #


def problems(tmp_path: pathlib.Path, *argv: str) -> list[str]:
    argv = argv if "--out" in argv else ("--out", str(tmp_path / "out"), *argv)
    return problems_of(parse("--workload", "mlp", *argv))


def test_a_fresh_request_passes(tmp_path):
    assert problems(tmp_path, "--ledger", str(tmp_path / "ledger")) == []


@NEEDS_TRANSFORMERS
def test_the_reference_alone_trains_one_arm_and_has_no_speed_up_to_gate(tmp_path):
    """``--arm-set reference`` (what review runs at a PR's base) trains the reference alone;
    ``--min-speedup`` gates candidates, so with it the request is refused, naming both."""
    plan = plan_of(parse("--out", str(tmp_path), "--arm-set", "reference"))
    assert [arm.name for arm in plan.arms] == ["reference"]
    assert problems(tmp_path, "--arm-set", "reference") == []
    found = problems(tmp_path, "--arm-set", "reference", "--min-speedup", "1.02")
    assert found == [
        "--min-speedup gates the candidates' speed-up: --arm-set reference trains none"
    ]


def test_out_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert problems(tmp_path, "--out", str(tmp_path / "file")) == [
        f"--out {tmp_path / 'file'}: exists and is not a directory"
    ]


def test_out_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    found = problems(tmp_path, "--out", str(tmp_path / "file" / "run"))
    assert found and "is not a directory" in found[0]


def test_out_that_is_not_writable(tmp_path, monkeypatch):
    # The suite may run as root, for whom every directory is writable: ask os.access.
    monkeypatch.setattr(files.os, "access", lambda *args, **kwargs: False)
    (tmp_path / "out").mkdir()
    assert problems(tmp_path) == [f"--out {tmp_path / 'out'}: the directory is not writable"]
    found = problems(tmp_path, "--out", str(tmp_path / "new" / "run"))
    assert found == [
        f"--out {tmp_path / 'new' / 'run'}: cannot create it, {tmp_path} is not writable"
    ]


def test_out_where_nothing_can_be_written_though_permissions_allow(tmp_path, monkeypatch):
    """Root passes os.access in /proc or on some network mounts; the run then trained for
    nothing and failed writing its record. A file is created and removed there first."""

    def cannot_write(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files.tempfile, "mkstemp", cannot_write)
    assert problems(tmp_path) == [
        f"--out {tmp_path / 'out'}: cannot create it in {tmp_path} (read-only file system)"
    ]
    (tmp_path / "out").mkdir()
    assert problems(tmp_path) == [
        f"--out {tmp_path / 'out'}: cannot write there (read-only file system)"
    ]


def test_an_existing_record_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "record.json").write_text("{}")
    found = problems(tmp_path)
    assert (
        len(found) == 1 and "already holds an earlier run (record.json); pass --force" in (found[0])
    )
    assert problems(tmp_path, "--force") == []
    assert problems(tmp_path, "--keep-previous", "3") == []


@pytest.mark.parametrize("left", ["harness-error.json", "timed-out.json", "interrupted.json"])
def test_an_earlier_run_without_a_record_needs_force_too(tmp_path, left):
    """Its file would be removed when the new run writes its own ([Note: results kept])."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / left).write_text("{}")
    assert problems(tmp_path) == [
        f"--out {tmp_path / 'out'}: already holds an earlier run ({left}); pass --force to "
        "replace it, --keep-previous N to move it aside, or choose another directory"
    ]
    (tmp_path / "out" / left).unlink()
    (tmp_path / "out" / "notes.txt").write_text("the user's, no run's")
    assert problems(tmp_path) == []


def test_keep_previous_and_force_are_one_choice(capsys):
    last = usage_error(capsys, "--out", "x", "--force", "--keep-previous", "2")
    assert "not allowed with argument" in last
    assert "--keep-previous: 0 is invalid" in usage_error(
        capsys, "--out", "x", "--keep-previous", "0"
    )


def test_keep_previous_is_refused_under_torchrun(tmp_path, monkeypatch):
    """Every torchrun rank writes into --out (its rank reports) while rank 0 would move it."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    found = problems(tmp_path, "--keep-previous", "2")
    assert "--keep-previous: not under torchrun; give each run its own --out" in found


def test_keep_previous_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out.2").write_text("x")
    assert problems(tmp_path, "--keep-previous", "1") == []
    assert problems(tmp_path, "--keep-previous", "2") == [
        f"--keep-previous: {tmp_path / 'out.2'} exists and is not a directory"
    ]


def test_a_repeated_group_size_is_refused_before_any_rank_starts(tmp_path):
    """Before: five arms trained, then `RecordError: arm names repeat`, exit 1, no record."""
    found = problems(tmp_path, "--group-size", "64", "--group-size", "64")
    assert found == ["--group-size 64 is given 2 times: each value is one arm; give it once"]
    found = problems(tmp_path, *["--group-size", "64"] * 3, "--group-size", "8192")
    assert found == ["--group-size 64 is given 3 times: each value is one arm; give it once"]


def test_one_rank_is_refused_unless_asked_for(tmp_path):
    """One rank sends nothing to quantize: INCONCLUSIVE is known before it starts."""
    assert problems(tmp_path, "--world-size", "1") == [
        "--world-size 1: one rank sends nothing to quantize, so the gather cannot be judged "
        "(the run would end INCONCLUSIVE); use 2 or more ranks, or --allow-one-rank for a "
        "smoke test"
    ]
    assert problems(tmp_path, "--world-size", "1", "--allow-one-rank") == []


def test_a_timeout_shorter_than_the_run_can_take_is_refused(tmp_path, monkeypatch):
    """[Note: the time floor]: the mlp workload's default run (4 arms of 20 steps, one timed
    candidate in 4 blocks of 2 + 5 steps per arm) on CPU ranks."""
    monkeypatch.setattr(launch, "pick_backend", lambda world_size: "gloo")
    found = problems(tmp_path, "--timeout", "3")
    assert len(found) == 1 and found[0].startswith(
        "--timeout 3: shorter than this run can take (at least 3.7 s: 136 steps of mlp at "
        "0.020 s or more each on a CPU rank, after 1 s to start the ranks)"
    ), found
    assert found[0].endswith("give more, e.g. --timeout 40")
    assert problems(tmp_path, "--timeout", "4") == []
    assert problems(tmp_path, "--timeout", "3", "--steps", "1", "--blocks", "0") == []


def test_ledger_that_is_a_file(tmp_path):
    (tmp_path / "ledger").write_text("x")
    assert problems(tmp_path, "--ledger", str(tmp_path / "ledger")) == [
        f"--ledger {tmp_path / 'ledger'}: exists and is not a directory"
    ]


def test_ledger_with_corrupt_and_non_utf8_entries(tmp_path):
    directory = tmp_path / "ledger"
    directory.mkdir()
    (directory / "a.json").write_bytes(b"\xff\xfe\x00")
    (directory / "b.json").write_text('{"head": "x"}')
    (directory / "c.json").write_text('{"final_hash": ')
    (directory / "d.json").write_text(
        '{"head": "h", "environment": "e", "workload": {}, "arm": {}, "final_hash": "f"}'
    )
    os.mkfifo(directory / "e.json")
    found = problems(tmp_path, "--ledger", str(directory))
    assert len(found) == 4, found
    assert "a.json: not UTF-8 text" in found[0]
    assert "b.json: missing environment, workload, arm, final_hash" in found[1]
    assert "c.json: not valid JSON" in found[2]
    assert "e.json: not a regular file (a FIFO)" in found[3]
    assert all(line.startswith("--ledger: corrupt entry ") for line in found)
    assert ledger.validate_directory(directory) == found


def test_group_size_larger_than_a_shard(tmp_path):
    found = problems(tmp_path, "--group-size", "1000000000")
    assert found == [
        "--group-size 1000000000: larger than a rank's whole shard of the mlp model "
        "(538,182 parameters / 2 ranks = 269,091); at most 269,096"
    ]
    assert problems(tmp_path, "--group-size", "269096") == []
    assert problems(tmp_path, "--group-size", "8192", "--group-size", "64") == []


def test_world_size_against_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "available_cores", lambda: 2)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: None)
    assert problems(tmp_path, "--world-size", "8") == []
    assert problems(tmp_path, "--world-size", "64") == [
        "--world-size 64: this machine has 2 CPU cores; local ranks are limited to 4 per "
        "core (8); use torchrun across machines for more"
    ]


def test_world_size_against_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "available_cores", lambda: 64)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 2 * 2**30)
    assert problems(tmp_path, "--world-size", "2") == []
    found = problems(tmp_path, "--world-size", "8")
    assert len(found) == 1 and "GiB of host memory needed for 8 CPU ranks" in found[0]
    assert "2.0 GiB available" in found[0]


def test_cmd_run_refuses_with_exit_2_before_launching(tmp_path, monkeypatch, capsys):
    def must_not_launch(*args, **kwargs):
        raise AssertionError("launched although the request was refused")

    monkeypatch.setattr(launch, "launch", must_not_launch)
    (tmp_path / "file").write_text("x")
    code = cli.main(["run", "--out", str(tmp_path / "file"), "--workload", "mlp"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"qwz-qualify run: error: --out {tmp_path / 'file'}: exists and is not a directory\n"
    )


RUN = ["--workload", "mlp", "--kernels", "eager"]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_exits_128_plus_signal_and_says_how_far_it_got(
    tmp_path, monkeypatch, capsys, signum, code
):
    """[Note: unfinished runs]: interrupted.json, what ran and what did not; no record."""

    def interrupted(*args, **kwargs):
        stopped = launch.Interrupted(signum)
        stopped.ranks = launch.RanksSoFar(
            {0: ["reference"], 1: ["reference"]},
            {0: {"arm": "calibration-g64", "step": 3}, 1: {"arm": "calibration-g64", "step": 2}},
        )
        raise stopped

    monkeypatch.setattr(launch, "launch", interrupted)
    out = tmp_path / "out"
    assert cli.main(["run", "--out", str(out), *RUN]) == code
    assert sorted(path.name for path in out.iterdir()) == ["interrupted.json"]
    written = json.loads((out / "interrupted.json").read_text())
    name = signal.Signals(signum).name
    assert written["verdict"] is None and written["interrupted"] == name
    assert written["phase"] == "training the arms"
    assert written["arms"]["finished"] == ["reference"]
    assert written["arms"]["running"] == "calibration-g64"
    assert written["arms"]["not_started"] == ["candidate-g64", "candidate-g64-chunked"]
    captured = capsys.readouterr()
    assert f"interrupted by {name}" in captured.err
    assert (
        f"INTERRUPTED (no verdict): interrupted by {name} while training the arms in arm "
        "calibration-g64 at step 2; arms finished: reference"
    ) in captured.out
    assert cli.main(["report", str(out)]) == 2  # never read as a verdict
    assert "its run left no record: INTERRUPTED (no verdict)" in capsys.readouterr().err


def test_a_signal_after_the_record_is_written_keeps_it(tmp_path, monkeypatch, capsys):
    """The run is done once its record is written: a late Ctrl-C must not replace it."""
    from qwz.qualify.evidence import build, record
    from qwz.qualify.review import run_files
    from tests.unit.records import make_record

    def written_then_interrupted(built, out):
        record.save(make_record(), out / "record.json")
        raise launch.Interrupted(signal.SIGINT)

    monkeypatch.setattr(launch, "launch", lambda *args, **kwargs: [[]])
    monkeypatch.setattr(build, "build_record", lambda *args, **kwargs: None)
    monkeypatch.setattr(run_files, "write_evidence", written_then_interrupted)
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["run", "--out", str(out), *RUN]) == 130
    assert sorted(path.name for path in out.iterdir()) == ["record.json"]


def test_a_run_that_outlasts_its_timeout_has_its_own_verdict_naming_the_limit(
    tmp_path, monkeypatch, capsys
):
    """Before: exit 1, a FAIL record, `FAIL: finite[reference]`, "a hang or a deadlock"."""

    def times_out(*args, **kwargs):
        ends = [
            RankEnd(rank, "timeout", "still running", (), None, None, where, 0.0)
            for rank, where in enumerate([{"arm": "reference", "step": 15}] * 2)
        ]
        failure = launch.rank_failure(ends, 2, "qualify_rank", " within 8 s", {}, tmp_path)
        failure.limit_s = 8.0
        raise failure

    monkeypatch.setattr(launch, "launch", times_out)
    out = tmp_path / "out"
    assert cli.main(["run", "--out", str(out), *RUN, "--timeout", "8"]) == 3
    assert sorted(path.name for path in out.iterdir()) == ["timed-out.json"]
    written = json.loads((out / "timed-out.json").read_text())
    assert (written["verdict"], written["limit_s"]) == ("TIMED-OUT", 8.0)
    assert written["arms"]["running"] == "reference" and written["arms"]["finished"] == []
    said = capsys.readouterr().out
    assert (
        "TIMED-OUT: the run's time limit, --timeout 8 s, ran out in arm reference at step 15"
        in (said)
    )
    assert "FAIL" not in said
    assert cli.main(["report", str(out)]) == 2
    assert "its run left no record: TIMED-OUT" in capsys.readouterr().err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_raise_interrupted_inside_and_are_restored_after(signum, code):
    before = signal.getsignal(signum)
    with pytest.raises(launch.Interrupted) as interrupted, launch.signals_interrupt():
        os.kill(os.getpid(), signum)
        signal.sigtimedwait([], 0)  # let the handler run if delivery is deferred
    assert interrupted.value.exit_code == code
    assert signal.getsignal(signum) is before


# --------------------------------------------------------------------------- #
# Atomic writes
# --------------------------------------------------------------------------- #


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    files.atomic_write_text(path, "old\n")
    assert path.read_text() == "old\n"

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_text(path, "new and longer\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]  # no temp left


def test_atomic_write_keeps_the_usual_file_mode(tmp_path):
    path = tmp_path / "report.md"
    files.atomic_write_text(path, "# report\n")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


# --------------------------------------------------------------------------- #
# Fuzz over run's argument vectors: a Namespace or exit 2 with one error line
# --------------------------------------------------------------------------- #

FLAGS = [
    "--world-size", "--steps", "--stage", "--group-size", "--dtype", "--workload", "--subject",
    "--blocks", "--block-steps", "--warmup-steps", "--seed", "--lr", "--allgather-bucket-size",
    "--kernels", "--min-speedup", "--timeout", "--ledger",
]  # fmt: skip
SWITCHES = [
    "--calibration", "--no-calibration", "--qwz-gather", "--no-qwz-gather", "--force",
    "--one-arm-at-a-time",
]  # fmt: skip
VALUES = st.sampled_from(
    ["0", "1", "2", "-1", "64", "8192", "1e3", "nan", "inf", "-inf", "1e400", "0x10", "",
     " 3", "9" * 40, "bf16", "mlp", "qwz", "--", "-", "1_000", "\u0663", "2.0"]
) | st.text(max_size=8)  # fmt: skip

ARGV = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(FLAGS), VALUES).map(list),
        st.sampled_from(SWITCHES).map(lambda switch: [switch]),
    ),
    max_size=6,
).map(lambda pairs: [token for pair in pairs for token in pair])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=ARGV)
def test_argument_vectors_parse_or_exit_2_with_one_error_line(capsys, argv):
    try:
        args = parse("--out", "runs/x", *argv)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "invalid literal" not in err
        assert "invalid int value" not in err and "invalid float value" not in err
        assert err.strip().splitlines()[-1].startswith("qwz-qualify run: error: ")
        return
    values = run_request.preset_values(args)  # unset: the preset's values
    for value in (values["lr"], values["timeout"]):
        assert value > 0 and value != float("inf")
    assert values["steps"] >= 1 and values["blocks"] >= 0 and values["block_steps"] >= 1
    assert values["warmup_steps"] >= 0 and 0 <= values["seed"] < 2**63
    assert all(size > 0 and size % 8 == 0 for size in values["group_sizes"])
    assert values["min_speedup"] is None or abs(values["min_speedup"]) != float("inf")


@pytest.mark.parametrize(
    ("argv", "replacement"),
    [
        (["--bucket-size", "65536"], "--allgather-bucket-size N --reduce-bucket-size N"),
        (["--no-compile"], "--kernels eager"),
        (["--compile"], "--kernels fused"),
        (["--no-integration"], "--no-qwz-gather"),
        (["--initial-scale-power", "8"], "--fp16-initial-scale-power"),
    ],
)
def test_a_renamed_flag_is_refused_naming_its_replacement(capsys, argv, replacement):
    last = usage_error(capsys, "--out", "somewhere", *argv)
    assert f"{argv[0]} was renamed: use {replacement}" in last


@NEEDS_TRANSFORMERS
def test_each_bucket_is_its_own_setting():
    """``--allgather-bucket-size`` no longer sets the reduce bucket too."""
    plan = plan_of(parse("--out", "x", "--allgather-bucket-size", "65536"))
    candidate = next(arm for arm in plan.arms if arm.name == "candidate-g64")
    zero = plan.arm_config(candidate)["zero_optimization"]
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (65536, 500_000_000)
    plan = plan_of(parse("--out", "x", "--reduce-bucket-size", "4096"))
    zero = plan.arm_config(plan.arms[0])["zero_optimization"]
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (500_000_000, 4096)
