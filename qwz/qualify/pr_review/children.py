"""One of the review's two runs: its finished record reused, or ``qwz-qualify run`` as a
supervised child process ([Note: supervising a run], qualify/base/supervise.py) and how it ended.

How a run's end reads (as a matrix cell's, qualify/matrix/cells.py): exit 0, 1 or 3 with a
record of the plan asked for and the commit asked for is its record's verdict under today's
rules; exit 2 is "refused" with ``run``'s own refusal; exit 4 with ``harness-error.json`` is
HARNESS-ERROR; stopped by the review's SIGINT/SIGTERM is "interrupted"; anything else, or a
verdict exit without such a record, is "crashed" with why.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from qwz.qualify.base import supervise
from qwz.qualify.base.supervise import Stop
from qwz.qualify.evidence import harness_error
from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.rules import family_of
from qwz.qualify.evidence.schema import Record
from qwz.qualify.matrix.cells import (
    VERDICT_EXITS,
    expected_request,
    finished_record,
    recorded_plan,
    refusal_reason,
)
from qwz.qualify.pr_review import checkout
from qwz.qualify.review.pr_review import REFUSED, Side


class Logs(NamedTuple):
    stdout: pathlib.Path
    stderr: pathlib.Path


Launcher = Callable[[list[str], Logs, Stop], int]
"""Runs ``qwz-qualify <argv>`` with its output in the logs and returns its exit status (the
seam the unit tests replace)."""


def subprocess_launcher(argv: list[str], logs: Logs, stop: Stop) -> int:
    """``python -m qwz.qualify <argv>``, supervised."""
    with logs.stdout.open("w") as stdout, logs.stderr.open("w") as stderr:
        command = [sys.executable, "-m", "qwz.qualify", *argv]
        return supervise.run(command, stop, stdout=stdout, stderr=stderr)


class Run(NamedTuple):
    """One side of the review: what to run, and where."""

    side: str
    """"base" or "head"."""
    ref: str
    sha: str
    arguments: list[str]
    """``run`` arguments without ``--out``."""
    out: pathlib.Path
    """The review's directory; the run's is ``out/side``."""

    @property
    def directory(self) -> pathlib.Path:
        return self.out / self.side


def _expected(run: Run, parser: argparse.ArgumentParser) -> tuple[dict | None, int]:
    """The plan and world size of the record ``run`` would write ([Note: a request resolved
    once]); no plan where this build's ``run`` refuses the arguments."""
    request = expected_request(parser, run.arguments, run.directory)
    if request is None:
        return None, 0
    return recorded_plan(request), request.world_size


def finished(run: Run, parser: argparse.ArgumentParser) -> tuple[Record | None, str]:
    """The run's record, when it is finished ([Note: review resume]); else None and why."""
    plan, world_size = _expected(run, parser)
    record, why = finished_record(run.directory, plan, world_size)
    if record is not None and record.head.sha != run.sha:
        return None, f"its record is of commit {record.head.sha[:12]}, not {run.sha[:12]}"
    return record, why


def _side(run: Run, status: str, kind: str, reason: str, **fields) -> Side:
    record: Record | None = fields.get("record")
    return Side(
        side=run.side,
        ref=run.ref,
        sha=run.sha,
        status=status,
        kind=kind,
        reason=reason,
        record=None if record is None else f"{run.side}/record.json",
        digest=None if record is None else record.digest,
        wall_s=fields.get("wall_s"),
    )


def not_run(run: Run, why: str, status: str = "not run") -> Side:
    return _side(run, status, "-", why)


BASE_CONTEXT = ("conformance",)
"""Check families that are context at the base, never its verdict: the base need not
implement the PR, so stock DeepSpeed FAILs the PR's config rules there by design (the claims
table shows the base's rows beside the head's)."""


def _verdict(record: Record, side: str) -> tuple[str, str]:
    """The record's verdict under today's rules, and its failed (else inconclusive) checks;
    at the base, without :data:`BASE_CONTEXT`."""
    verdict = rejudged(record).verdict
    if side != "base":
        return verdict.status, ", ".join(verdict.failed or verdict.inconclusive)
    failed = [name for name in verdict.failed if family_of(name) not in BASE_CONTEXT]
    undecided = [name for name in verdict.inconclusive if family_of(name) not in BASE_CONTEXT]
    status = "FAIL" if failed else "INCONCLUSIVE" if undecided else "PASS"
    return status, ", ".join(failed or undecided)


def resumed(run: Run, record: Record) -> Side:
    status, why = _verdict(record, run.side)
    return _side(run, status, "resumed", why, record=record)


def _stopped(stop: Stop, code: int) -> bool:
    """Whether `code` is the run's end on the review's signal (its own exit, or the SIGKILL
    after ``supervise.STOP_GRACE_S``)."""
    return stop.signum is not None and code in (128 + stop.signum, -stop.signum, -signal.SIGKILL)


def ended(
    run: Run, parser: argparse.ArgumentParser, code: int, logs: Logs, stop: Stop, wall_s: float
) -> tuple[Side, Record | None]:
    """How the run ended with `code` (module docstring), and its record where it has one."""
    stderr = logs.stderr.read_text(errors="replace") if logs.stderr.is_file() else ""
    if code == 2:
        return _side(run, REFUSED, "ran", refusal_reason(stderr), wall_s=wall_s), None
    if _stopped(stop, code):
        name = signal.Signals(stop.signum).name
        return _side(run, "interrupted", "ran", f"stopped by {name}: no record"), None
    if code in harness_error.UNJUDGED_EXITS:
        said = harness_error.read_summary(run.directory)
        reason = said or f"exit {code} without a readable {harness_error.FILE_NAME}"
        verdict = harness_error.UNJUDGED_EXITS[code]
        return _side(run, verdict, "ran", reason, wall_s=wall_s), None
    if code in VERDICT_EXITS:
        record, why = finished(run, parser)
        if record is not None:
            status, reason = _verdict(record, run.side)
            return _side(run, status, "ran", reason, record=record, wall_s=wall_s), record
        reason = f"run exited {code} ({VERDICT_EXITS[code]}) but {why}"
    elif code < 0:
        reason = f"run was killed by {signal.Signals(-code).name}"
    else:
        reason = f"run exited {code}, which run never gives for a finished run"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    reason += f" (last stderr line: {last.strip()[:300]})" if last else ""
    return _side(run, "crashed", "ran", reason, wall_s=wall_s), None


def launch(
    run: Run,
    parser: argparse.ArgumentParser,
    worktree: tuple[pathlib.Path, pathlib.Path],
    stop: Stop,
    launcher: Launcher = subprocess_launcher,
) -> tuple[Side, Record | None]:
    """Check the run's commit out in the review's worktree (`worktree`: the repository and
    the worktree's path) and run it, supervised."""
    repository, path = worktree
    checkout.check_out(repository, path, run.sha)
    logs_dir = run.out / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    run.directory.mkdir(parents=True, exist_ok=True)
    logs = Logs(logs_dir / f"{run.side}.out", logs_dir / f"{run.side}.err")
    argv = ["run", *run.arguments, "--out", str(run.directory), "--force"]
    started = time.monotonic()
    code = launcher(argv, logs, stop)
    return ended(run, parser, code, logs, stop, time.monotonic() - started)
