"""``qwz-qualify run`` refuses what it cannot do before any rank starts, writes atomically,
and turns SIGINT/SIGTERM into exit 130/143 (issue 9, "run fails fast and cleans up").

No training here: flags go through ``build_parser`` and ``check_run_request`` (the
``mlp`` workload, counted on the meta device); ``launch`` is replaced where ``cmd_run``
must get past the checks. The real SIGTERM of a running ``run`` is in
``tests/multigpu/test_run_signals.py``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwz.qualify import cli, files, preflight
from qwz.qualify.evidence import ledger
from qwz.qualify.run import launch
from tests.extras import NEEDS_TRANSFORMERS


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
# check_run_request
# --------------------------------------------------------------------------- #


def problems(tmp_path: pathlib.Path, *argv: str) -> list[str]:
    argv = argv if "--out" in argv else ("--out", str(tmp_path / "out"), *argv)
    return preflight.check_run_request(parse("--workload", "mlp", *argv))


def test_a_fresh_request_passes(tmp_path):
    assert problems(tmp_path, "--ledger", str(tmp_path / "ledger")) == []


@NEEDS_TRANSFORMERS
def test_the_reference_alone_trains_one_arm_and_has_no_speed_up_to_gate(tmp_path):
    """``--arm-set reference`` (what review runs at a PR's base) trains the reference alone;
    ``--min-speedup`` gates candidates, so with it the request is refused, naming both."""
    plan = preflight.plan_of(parse("--out", str(tmp_path), "--arm-set", "reference"))
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


def test_an_existing_record_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "record.json").write_text("{}")
    found = problems(tmp_path)
    assert len(found) == 1 and "already holds a record.json; pass --force" in found[0]
    assert problems(tmp_path, "--force") == []


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


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_exits_128_plus_signal_and_writes_nothing(
    tmp_path, monkeypatch, capsys, signum, code
):
    def interrupted(*args, **kwargs):
        raise launch.Interrupted(signum)

    monkeypatch.setattr(launch, "launch", interrupted)
    out = tmp_path / "out"
    argv = ["run", "--out", str(out), "--workload", "mlp", "--kernels", "eager"]
    assert cli.main(argv) == code
    assert not out.exists()
    assert f"interrupted by {signal.Signals(signum).name}" in capsys.readouterr().err


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
    preflight.apply_preset(args)  # the flags left unset get the preset's values
    for value in (args.lr, args.timeout):
        assert value > 0 and value != float("inf")
    assert args.steps >= 1 and args.blocks >= 0 and args.block_steps >= 1
    assert args.warmup_steps >= 0 and 0 <= args.seed < 2**63
    assert all(size > 0 and size % 8 == 0 for size in args.group_sizes or ())
    assert args.min_speedup is None or abs(args.min_speedup) != float("inf")


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
    plan = preflight.plan_of(parse("--out", "x", "--allgather-bucket-size", "65536"))
    zero = plan.arm_config(plan.arms[-1])["zero_optimization"]
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (65536, 500_000_000)
    plan = preflight.plan_of(parse("--out", "x", "--reduce-bucket-size", "4096"))
    zero = plan.arm_config(plan.arms[0])["zero_optimization"]
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (500_000_000, 4096)
