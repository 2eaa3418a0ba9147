"""One trial: check a commit out, set it up, qualify it in a subprocess, note how it ended.

The qualification is ``python -m qwz.qualify run --out <attempt> <run arguments>`` with the
commit importable ([Note: the judge is the bisecting head's] in qualify/bisect/__init__.py):
for the ``qwz`` subject the worktree (holding the harness snapshot) is first on PYTHONPATH;
for a DeepSpeed subject the bisecting qwz is, with ``--deepspeed-src <worktree>``.

[Note: stopping a trial]
  The trial runs in its own session, so a Ctrl-C in the terminal reaches the bisect alone;
  SIGINT or SIGTERM to the bisect is passed on to the run (which stops every rank and writes
  nothing, qwz/qualify/run/launch.py [Note: no orphaned ranks]) and, once it has exited, ends the
  bisect with :class:`qwz.qualify.run.launch.Interrupted` ([Note: supervising a run],
  qualify/base/supervise.py, which the matrix shares). Nothing is removed: the attempt keeps no
  outcome, so a resumed bisect runs it again, and every finished attempt stays as it was.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from qwz.qualify.base import supervise
from qwz.qualify.bisect import worktrees
from qwz.qualify.bisect.state import Attempt
from qwz.qualify.evidence import harness_error
from qwz.qualify.run.launch import Interrupted

QWZ_ROOT = worktrees.HARNESS_PACKAGE.parents[1]
"""The directory holding the bisecting qwz's ``qwz`` package (a DeepSpeed subject's path)."""


def _run_logged(command: list[str], cwd: pathlib.Path, env: dict[str, str], log: pathlib.Path):
    """Exit status of `command`, its output in `log`; SIGINT/SIGTERM are passed on
    ([Note: stopping a trial])."""
    stop = supervise.Stop()
    with open(log, "wb") as output, stop.installed():
        code = supervise.run(
            command, stop, stdout=output, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )
    if stop.signum is not None:
        raise Interrupted(stop.signum)
    return code


def _last_line(log: pathlib.Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"


def _environment(first_on_path: pathlib.Path, sha: str) -> dict[str, str]:
    env = dict(os.environ)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(first_on_path) + (os.pathsep + rest if rest else "")
    env["QWZ_BISECT_COMMIT"] = sha
    return env


def _prepare(request: dict[str, Any], out: pathlib.Path, sha: str, attempt: Attempt):
    """The worktree of `sha`, ready to qualify, and the run's extra arguments; or a reason
    (str) it cannot be qualified."""
    repository = pathlib.Path(request["repository"])
    worktree = worktrees.check_out(repository, out, sha)
    if request["subject"] == "qwz":
        if not worktrees.install_harness(worktree, out / "harness" / "qualify"):
            return worktree, "not importable: the commit has no qwz/ package"
        extra: list[str] = []
    else:
        extra = ["--deepspeed-src", str(worktree)]
    if request["setup"]:
        log = attempt.directory / "setup.log"
        status = _run_logged(
            ["bash", "-c", request["setup"]], worktree, _environment(worktree, sha), log
        )
        if status != 0:
            return worktree, f"not buildable: --setup exited {status}: {_last_line(log)}"
    return worktree, extra


def run_trial(request: dict[str, Any], out: pathlib.Path, attempt: Attempt) -> dict[str, Any]:
    """Qualify `attempt.sha` into `attempt.directory`; its outcome (written beside the
    record): exit code, seconds, and why there is no record where there is none."""
    started = time.monotonic()
    worktree, prepared = _prepare(request, out, attempt.sha, attempt)
    exit_code = None
    why = prepared if isinstance(prepared, str) else None
    if why is None:
        first_on_path = worktree if request["subject"] == "qwz" else QWZ_ROOT
        # --force: the attempt directory is the bisect's; what an interrupted trial left
        # there (interrupted.json, [Note: unfinished runs]) is replaced when it runs again.
        command = [sys.executable, "-m", "qwz.qualify", "run", "--out", str(attempt.directory),
                   "--force", *prepared, *request["run_args"]]  # fmt: skip
        log = attempt.directory / "run.log"
        env = _environment(first_on_path, attempt.sha)
        exit_code = _run_logged(command, worktree, env, log)
        if exit_code in harness_error.UNJUDGED_EXITS:
            # [Note: harness errors], [Note: cannot run on this runner]: the commit was not
            # judged, so it is skipped
            said = harness_error.read_summary(attempt.directory)
            verdict = harness_error.UNJUDGED_EXITS[exit_code]
            why = said or f"{verdict} (exit {exit_code}): {_last_line(log)}"
        elif not attempt.record.is_file():
            why = f"no record (exit {exit_code}): {_last_line(log)}"
    outcome = {"exit_code": exit_code, "wall_s": round(time.monotonic() - started, 3), "why": why}
    attempt.write_outcome(outcome)
    worktrees.remove(pathlib.Path(request["repository"]), worktree)
    return outcome
