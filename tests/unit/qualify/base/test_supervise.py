"""[Note: supervising a run] (qualify/base/supervise.py): the one supervisor of the matrix's cells
and bisect's trials, on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from qwz.qualify.base import supervise

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('started', flush=True)\ntime.sleep(60)\n"
)


def _signal_when_started(stop: supervise.Stop, log, signum: int) -> threading.Thread:
    """Deliver `signum` to the parent's handler once the child has printed 'started'."""

    def deliver() -> None:
        while "started" not in log.read_text():
            time.sleep(0.05)
        stop.handle(signum, None)

    thread = threading.Thread(target=deliver, daemon=True)
    thread.start()
    return thread


def test_an_exit_status_is_returned_and_output_kept(tmp_path):
    log = tmp_path / "log"
    with log.open("w") as out:
        code = supervise.run(
            [sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
            supervise.Stop(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert code == 3 and log.read_text().strip() == "hello"


def test_a_signal_is_passed_on_once_and_the_child_stops(tmp_path):
    log, stop = tmp_path / "log", supervise.Stop()
    with log.open("w") as out:
        thread = _signal_when_started(stop, log, signal.SIGTERM)
        started = time.monotonic()
        code = supervise.run([sys.executable, "-c", SLEEPER], stop, stdout=out, stderr=out)
    thread.join()
    assert code == -signal.SIGTERM and stop.signum == signal.SIGTERM
    assert time.monotonic() - started < 30 and stop.child is None


def test_a_child_that_ignores_the_signal_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(supervise, "POLL_S", 0.1)
    log, stop = tmp_path / "log", supervise.Stop()
    with log.open("w") as out:
        thread = _signal_when_started(stop, log, signal.SIGTERM)
        code = supervise.run([sys.executable, "-c", STUBBORN], stop, stdout=out, stderr=out)
    thread.join()
    assert code == -signal.SIGKILL


def test_a_signal_before_the_child_exists_keeps_it_from_starting(monkeypatch):
    stop = supervise.Stop()
    stop.handle(signal.SIGINT, None)  # between two cells: no child yet
    started = []
    monkeypatch.setattr(supervise.subprocess, "Popen", lambda *a, **k: started.append(a))
    code = supervise.run(
        [sys.executable, "-c", SLEEPER], stop, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert code == -signal.SIGINT and not started


def test_the_child_runs_in_its_own_session(tmp_path):
    log = tmp_path / "log"
    with log.open("w") as out:
        supervise.run(
            [sys.executable, "-c", "import os; print(os.getsid(0))"],
            supervise.Stop(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert int(log.read_text()) != os.getsid(0)
