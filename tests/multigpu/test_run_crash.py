"""A rank that fails on its own never hangs the others, and the record names it
([Note: failures] in qwz/qualify/run/runner.py, [Note: the rank that failed first] in
qwz/qualify/base/rank_reports.py): ``qwz-qualify run`` ends within seconds of the failure with
exit 1 and a FAIL record naming the rank, the arm, the last completed step and the exception or
signal; the arms every rank finished are judged, the ones after are "not run"."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from qwz.qualify.evidence import record
from qwz.qualify.run.launch import pick_backend

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

RUN = [
    "--workload", "mlp", "--steps", "6", "--eval-every", "2", "--blocks", "1",
    "--block-steps", "1", "--warmup-steps", "0", "--world-size", "2", "--kernels", "eager",
    "--group-size", "64", "--group-size", "128",
]  # fmt: skip
FAILING_RANK, FAILING_STEP = 1, 3
BOUND_S = 30.0
"""The run must end this soon after the failure; the collective timeout is 3600 s."""
HOOK = "tests.multigpu.test_run_crash:raise_on_rank_1_at_step_3"


def raise_on_rank_1_at_step_3(arm, engine, plan):
    """arm_hook: candidate-g64's train_step raises on rank 1 at step 3, the others wait in
    the step's collectives (the shape of a CUDA OOM on one card)."""
    if arm.group_size != 64:
        return engine
    train_step, steps = engine.train_step, [0]

    def failing_train_step(loss):
        steps[0] += 1
        if dist.get_rank() == FAILING_RANK and steps[0] == FAILING_STEP:
            print(f"INJECTED at {time.time()}", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected failure on rank {FAILING_RANK}, step {steps[0]}")
        train_step(loss)

    engine.train_step = failing_train_step
    return engine


def with_hook() -> None:
    """This process's ``run`` resolves its request with the plan's arm_hook set (the CLI has
    no flag for the seam)."""
    from qwz.qualify.request import run_request

    resolve = run_request.resolve

    def resolve_with_hook(args):
        request = resolve(args)
        plan = dataclasses.replace(request.plan, arm_hook=HOOK)
        return dataclasses.replace(request, plan=plan)

    run_request.resolve = resolve_with_hook


def _cli_with_hook(out: pathlib.Path) -> list[str]:
    """`qwz-qualify run` with the plan's arm_hook set (the CLI has no flag for the seam)."""
    code = (
        "import sys; from qwz.qualify import cli; "
        "from tests.multigpu.test_run_crash import with_hook; with_hook(); "
        f"sys.exit(cli.main(['run', '--out', {str(out)!r}, *{RUN!r}]))"
    )
    return [sys.executable, "-c", code]


def test_an_exception_on_one_rank_ends_the_run_and_the_record_names_it(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        _cli_with_hook(out),
        capture_output=True,
        text=True,
        timeout=300,  # before the fix the peers wait 3600 s in the step's collective
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )
    ended = time.time()
    injected = re.search(r"INJECTED at ([0-9.]+)", done.stderr)
    assert injected, done.stderr[-3000:]
    assert ended - float(injected.group(1)) < BOUND_S, done.stderr[-3000:]
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    loaded = record.load(out / "record.json")
    trajectories = {t.arm: t for t in loaded.trajectories}
    failure = trajectories["candidate-g64"].failure
    assert failure is not None and failure.kind == "crash", failure
    assert (failure.rank, failure.step, failure.last_completed_step) == (1, 3, 2)
    assert failure.phase == "train" and failure.signal is None
    assert "RuntimeError: injected failure on rank 1, step 3" in failure.message
    assert any("failing_train_step" in line for line in failure.traceback)
    # The arms every rank finished are kept and judged; the one after the crash is not run.
    assert trajectories["candidate-g128"].failure.kind == "not-run"
    for arm in ("reference", "calibration-g128"):
        assert trajectories[arm].failure is None and len(trajectories[arm].losses) == 6
    assert loaded.verdict.failed == ["finite[candidate-g64]"], loaded.verdict
    assert "step1-exact[candidate-g128]" not in loaded.verdict.evidence
    report = (out / "report.md").read_text()
    assert "`candidate-g64` crashed on rank 1: phase train; last completed step 2" in report
    assert "Not run (the run ended before they started): `candidate-g128`" in report


def test_an_exception_under_torchrun_writes_the_record_a_local_run_would(tmp_path):
    """[Note: a crash under torchrun] (qwz/qualify/run/torchrun.py): torchrun starts the ranks, so
    no launcher of qwz's reads their reports; the rank that fails writes the record, naming the
    rank, the arm and the step, and keeps the arms every rank finished."""
    out = tmp_path / "out"
    at = RUN.index("--world-size")  # torchrun's world instead
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run(
        [*torchrun, "2", "-m", __name__, "run", "--out", str(out), *RUN[:at], *RUN[at + 2 :]],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr[-3000:]
    assert "INJECTED at" in done.stderr, done.stderr[-3000:]
    loaded = record.load(out / "record.json")
    trajectories = {t.arm: t for t in loaded.trajectories}
    failure = trajectories["candidate-g64"].failure
    assert failure is not None and failure.kind == "crash", failure
    assert (failure.rank, failure.step, failure.last_completed_step) == (1, 3, 2)
    assert failure.phase == "train"
    assert "RuntimeError: injected failure on rank 1, step 3" in failure.message
    assert any("failing_train_step" in line for line in failure.traceback)
    assert trajectories["candidate-g128"].failure.kind == "not-run"
    for arm in ("reference", "calibration-g128"):
        assert trajectories[arm].failure is None and len(trajectories[arm].losses) == 6
    assert loaded.verdict.failed == ["finite[candidate-g64]"], loaded.verdict
    report = (out / "report.md").read_text()
    assert "`candidate-g64` crashed on rank 1: phase train; last completed step 2" in report


def _rank_processes(parent: int) -> list[int]:
    """The launcher's rank processes in start order (rank order): its children that lead
    their own process group ([Note: no orphaned ranks]), forked or spawned ([Note: forked
    ranks]); no other child of the launcher leads one."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        ppid, pgid, started = int(fields[1]), int(fields[2]), int(fields[19])
        if ppid == parent and pgid == pid:
            found.append((started, pid))
    return [pid for _, pid in sorted(found)]


def test_a_killed_rank_is_named_with_its_signal_arm_and_last_step(tmp_path):
    out, reports = tmp_path / "out", tmp_path / "tmp"
    reports.mkdir()
    long_run = [*RUN[:2], "--steps", "100000", "--eval-every", "1000", *RUN[6:]]
    long_run += ["--timeout", "86400"]  # a limit it could meet ([Note: the time floor])
    process = subprocess.Popen(
        [sys.executable, "-m", "qwz.qualify", "run", "--out", str(out), *long_run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(reports)),
    )
    lines: list[str] = []
    training = threading.Event()

    def read_stderr() -> None:
        for line in process.stderr:
            lines.append(line)
            if re.search(r"reference step 10/", line):
                training.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert training.wait(timeout=240), "".join(lines)[-3000:]
        ranks = _rank_processes(process.pid)
        assert len(ranks) == 2, ranks
        if pick_backend(2) == "gloo" and not torch.cuda.is_available():  # [Note: forked ranks]
            commands = [pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() for pid in ranks]
            assert not any(b"spawn_main" in command for command in commands), commands
        os.kill(ranks[1], signal.SIGSTOP)  # frozen: its last report cannot change any more
        where_files = list(reports.glob("qwz-rank-reports-*/rank00001.where.json"))
        where = where_files[0].read_text() if where_files else ""
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        code = process.wait(timeout=120)
        took_s = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 1, "".join(lines)[-3000:]
    assert took_s < BOUND_S, took_s
    loaded = record.load(out / "record.json")
    failure = loaded.trajectories[0].failure
    assert loaded.trajectories[0].arm == "reference"
    assert failure is not None and failure.kind == "crash", failure
    assert (failure.rank, failure.signal) == (1, "SIGKILL"), failure
    # The kill lands wherever the rank is in its step: training, or observing its shards at
    # the next forward ([Note: observed at the next use]), which is part of the same loop.
    assert failure.phase in ("train", "observe"), failure
    assert failure.message.startswith("was killed by SIGKILL (last completed step")
    assert failure.last_completed_step is not None and failure.last_completed_step >= 9
    assert f'"last_completed_step": {failure.last_completed_step}' in where, where
    # Killed in a step, the failure names that step; observing, the step it completed.
    observing = failure.phase == "observe"
    assert failure.step == failure.last_completed_step + (0 if observing else 1)
    # Rank 0's lost connection is context, not the cause.
    assert len(failure.context) == 1 and failure.context[0].startswith("rank 0 "), failure
    assert all(t.failure.kind == "not-run" for t in loaded.trajectories[1:])
    assert loaded.verdict.failed == ["finite[reference]"], loaded.verdict


if __name__ == "__main__":  # one rank under torchrun: `qwz-qualify <argv>` with the hook set
    from qwz.qualify import cli

    with_hook()
    sys.exit(cli.main(sys.argv[1:]))
