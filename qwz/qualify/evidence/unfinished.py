"""A run that ended with no verdict on its subject: its time limit ran out, or a signal
stopped it.

[Note: unfinished runs]
Neither is the subject's failure, and neither is a verdict, so no record is written (a
record's verdict judges the subject, [Note: failures] in qualify/run/runner.py); one small
file in ``--out`` says what happened instead, beside nothing of an earlier run's
([Note: results kept] in run_dir.py):

- ``timed-out.json``: the run's ``--timeout`` (the whole run of local ranks) ran out. Its
  verdict is ``TIMED-OUT``, naming the limit, where every rank was, the arms every rank
  finished and those never started; exit 3 (INCONCLUSIVE: nothing about the subject was
  decided). A hang and a slow run look alike from outside: a longer ``--timeout`` tells them
  apart. Where the limit cannot be met at all, the preflight refuses it first
  ([Note: the time floor] in qualify/request/time_floor.py).
- ``interrupted.json``: SIGINT or SIGTERM stopped the run (exit 130/143): the phase it was
  in, what ran and what did not. ``"verdict": null``: it is no verdict.

Record commands given such a directory refuse it naming the file (run_dir.record_in);
``matrix`` reads a timed-out cell as INCONCLUSIVE without a record (run again on its next
start). The arms' observations are not kept: a record of some arms would be judged as a
crash of the rest.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

TIMED_OUT = "TIMED-OUT"
TIMED_OUT_FILE = "timed-out.json"
INTERRUPTED_FILE = "interrupted.json"
FILES = (TIMED_OUT_FILE, INTERRUPTED_FILE)


class Progress(NamedTuple):
    """How far the ranks got: the arms in the plan's order."""

    finished: list[str]
    """Arms every rank finished."""
    running: str | None
    """The arm the ranks were in (None: none had started one)."""
    not_started: list[str]
    ranks: dict[int, dict[str, Any]]
    """Where each rank last said it was (arm, phase, step)."""


def progress(
    arms: Sequence[str],
    finished_by_rank: Mapping[int, Sequence[str]],
    where_by_rank: Mapping[int, Mapping[str, Any]],
) -> Progress:
    """The :class:`Progress` of `arms` given what each rank finished and where it was."""
    ranks = sorted(set(finished_by_rank) | set(where_by_rank))
    finished = [
        arm for arm in arms if ranks and all(arm in finished_by_rank.get(r, ()) for r in ranks)
    ]
    in_arm = [where.get("arm") for where in where_by_rank.values()]
    running = next((arm for arm in arms if arm not in finished and arm in in_arm), None)
    if running is None and finished and len(finished) < len(arms):
        running = next(arm for arm in arms if arm not in finished)
    not_started = [arm for arm in arms if arm not in finished and arm != running]
    return Progress(
        finished, running, not_started, {r: dict(where_by_rank.get(r, {})) for r in ranks}
    )


def _arms(progress: Progress) -> dict[str, Any]:
    return {
        "finished": progress.finished,
        "running": progress.running,
        "not_started": progress.not_started,
        "ranks": {str(rank): where for rank, where in progress.ranks.items()},
    }


def timed_out(
    limit_s: float, progress: Progress, seconds: float, invocation: dict | None
) -> dict[str, Any]:
    """The content of ``timed-out.json``."""
    return {
        "verdict": TIMED_OUT,
        "limit_s": limit_s,
        "why": f"the run's time limit, --timeout {limit_s:g} s, ran out",
        "arms": _arms(progress),
        "seconds": round(seconds, 1),
        "invocation": invocation,
    }


def interrupted(
    signal_name: str, phase: str, progress: Progress, seconds: float, invocation: dict | None
) -> dict[str, Any]:
    """The content of ``interrupted.json``: no verdict."""
    return {
        "verdict": None,
        "interrupted": signal_name,
        "why": f"interrupted by {signal_name} while {phase}",
        "phase": phase,
        "arms": _arms(progress),
        "seconds": round(seconds, 1),
        "invocation": invocation,
    }


def write(out: pathlib.Path, name: str, content: dict[str, Any]) -> pathlib.Path:
    """Write `content` as ``out/name`` (atomically)."""
    from qwz.qualify.base.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    atomic_write_text(path, json.dumps(content, indent=2, default=str) + "\n")
    return path


def summary(content: Mapping[str, Any]) -> str:
    """One line: the verdict (or "interrupted"), why, and how far the arms got."""
    arms = content.get("arms") or {}
    running = arms.get("running")
    where = ""
    if running:
        steps = [
            w.get("step") for w in (arms.get("ranks") or {}).values() if w.get("arm") == running
        ]
        steps = [step for step in steps if isinstance(step, int)]
        where = f" in arm {running}" + (f" at step {min(steps)}" if steps else "")
    finished = ", ".join(arms.get("finished") or []) or "none"
    not_started = ", ".join(arms.get("not_started") or []) or "none"
    head = content.get("verdict") or "INTERRUPTED (no verdict)"
    line = (
        f"{head}: {content.get('why')}{where}; arms finished: {finished}; not started: "
        f"{not_started}; nothing was judged"
    )
    if content.get("verdict") == TIMED_OUT:
        line += " (a hang looks the same: a longer --timeout tells them apart)"
    return line


def read_summary(out: pathlib.Path) -> str | None:
    """:func:`summary` of the unfinished-run file in `out`, None when there is none."""
    for name in FILES:
        try:
            content = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(content, dict):
            return summary(content)
    return None
