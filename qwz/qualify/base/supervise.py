"""One supervisor for the commands that run a whole qualification as a child process: the
matrix (a cell's ``run``) and bisect (a trial's ``run``).

[Note: supervising a run]
  The child starts in its own session, so a Ctrl-C in the terminal reaches the parent
  alone, and asks the kernel for SIGTERM when the parent dies (Linux), so even a SIGKILLed
  parent leaves no run behind. SIGINT or SIGTERM to the parent, while :meth:`Stop.installed`,
  is recorded once and passed on to the running child once, or keeps the next child from
  starting (``run`` then stops every rank and writes no record, only ``interrupted.json``:
  [Note: no orphaned ranks] in qualify/run/launch.py); a child still running
  ``STOP_GRACE_S`` after the signal is SIGKILLed with its whole session. The parent decides
  what a stop means (the matrix marks the cells not reached; bisect ends).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

STOP_GRACE_S = 60.0
"""How long a stopped run gets to stop its ranks before its session is killed."""
POLL_S = 1.0


class Stop:
    """SIGINT/SIGTERM while a supervised command runs: the first signal, and when it came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at_s: float | None = None
        """``time.monotonic()`` when the signal came."""
        self.child: subprocess.Popen | None = None

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.at_s = signum, time.monotonic()
            if self.child is not None and self.child.poll() is None:
                self.child.send_signal(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Stop]:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, self.handle) for signum in signals}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run(
    command: list[str],
    stop: Stop,
    *,
    stdout: IO[Any],
    stderr: IO[Any] | int,
    cwd: pathlib.Path | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Exit status of `command`, supervised as [Note: supervising a run] says. Stopped
    before it starts, the command does not start (``-signum``): a signal sent to a child whose
    interpreter is still starting up can be lost, and the run would go on to its end."""
    if stop.signum is not None:
        return -stop.signum
    child = _start(command, stop, stdout, stderr, cwd, env)
    try:
        while True:
            try:
                return child.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if stop.at_s is not None and time.monotonic() - stop.at_s > STOP_GRACE_S:
                    _kill_session(child)
    finally:
        stop.child = None


def _start(command, stop: Stop, stdout, stderr, cwd, env) -> subprocess.Popen:
    """The child, in a session of its own, known to `stop` ([Note: supervising a run])."""
    child = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=_die_with_parent,
    )  # fmt: skip
    stop.child = child
    if stop.signum is not None:  # the signal came while the child was being made
        child.send_signal(stop.signum)
    return child


def _kill_session(child: subprocess.Popen) -> None:
    """SIGKILL to every process of the child's session (its process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def run_within(
    command: list[str],
    stop: Stop,
    limit_s: float,
    *,
    stdout: IO[Any],
    stderr: IO[Any] | int,
    cwd: pathlib.Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, bool]:
    """`command` supervised as :func:`run`, for at most `limit_s` seconds: (its exit status,
    whether it was killed at the limit). At the limit, or when it ends, every process left in
    its session is SIGKILLed: what it started (a test's ranks) never outlives it."""
    if stop.signum is not None:
        return -stop.signum, False
    deadline = time.monotonic() + limit_s
    child = _start(command, stop, stdout, stderr, cwd, env)
    try:
        while True:
            try:
                return child.wait(
                    timeout=min(POLL_S, max(deadline - time.monotonic(), 0.01))
                ), False
            except subprocess.TimeoutExpired:
                late = stop.at_s is not None and time.monotonic() - stop.at_s > STOP_GRACE_S
                if late or (stop.signum is None and time.monotonic() >= deadline):
                    _kill_session(child)
                    return child.wait(), stop.signum is None
    finally:
        stop.child = None
        _kill_session(child)
