"""A run's directory (``run --out``): the files a run writes there, an earlier run kept or
replaced, and the record a record command finds in it.

[Note: results kept]
A run writes into ``--out`` its ``record.json``, ``report.md`` and plots, or, where it has no
verdict to record, one file saying why: ``harness-error.json`` ([Note: harness errors]),
``timed-out.json`` or ``interrupted.json`` ([Note: unfinished runs]). An earlier run there is
never replaced silently:

- by default the preflight refuses a directory that already holds a record;
- ``--keep-previous N`` moves the earlier run to ``OUT.1`` (``OUT.1`` to ``OUT.2``, ...) once
  the request is accepted, keeping N of them; the one beyond N is deleted and named. The main
  job (ci/qualify-cpu.sh) keeps its last 3 runs this way, as pytest keeps its last 3 base
  temporary directories;
- ``--force`` replaces it: whatever the new run ends with, every file of :data:`RUN_FILES` it
  did not write is removed, so no plot of the earlier run sits beside the new record and no
  earlier record beside a new ``timed-out.json``.

Files that are no run's (:data:`RUN_FILES` names every one) are never touched. A record
command given a directory reads its ``record.json``; a directory whose run left no record
is refused naming the file that says why (:func:`record_in`).
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterable

from qwz.qualify.evidence import harness_error, unfinished
from qwz.qualify.evidence.schema import RecordError

RECORD = "record.json"
REPORT = "report.md"
PLOT_FILES = ("loss.png", "held_out.png", "speedup.png", "step_times.png")
"""Every plot a run may draw (qualify/review/plots.py)."""
NO_VERDICT_FILES = (harness_error.FILE_NAME, *unfinished.FILES)
RUN_FILES = (RECORD, REPORT, *PLOT_FILES, *NO_VERDICT_FILES)


def holds_a_run(out: pathlib.Path) -> bool:
    """Whether `out` holds any file a run writes."""
    return out.is_dir() and any((out / name).exists() for name in RUN_FILES)


def remove_stale(out: pathlib.Path, written: Iterable[str]) -> list[str]:
    """Remove every file of :data:`RUN_FILES` in `out` but `written` (this run's); their
    names ([Note: results kept])."""
    keep = set(written)
    removed = []
    for name in RUN_FILES:
        if name not in keep and (out / name).is_file():
            (out / name).unlink()
            removed.append(name)
    return removed


def previous(out: pathlib.Path, index: int) -> pathlib.Path:
    """Where ``--keep-previous`` keeps the index-th run before the current one."""
    return out.with_name(f"{out.name}.{index}")


def keep_previous_problem(out: pathlib.Path, keep: int) -> str | None:
    """Why the earlier runs of `out` cannot be moved aside (a path in the way that is no
    directory), None when they can."""
    for index in range(1, keep + 1):
        path = previous(out, index)
        if path.exists() and not path.is_dir():
            return f"--keep-previous: {path} exists and is not a directory"
    return None


def keep_previous(out: pathlib.Path, keep: int) -> list[str]:
    """Move the run in `out` to ``OUT.1``, shifting the earlier ones up and deleting the one
    beyond `keep` (at least 1) ([Note: results kept]); what was done, one line each. Nothing
    to do where `out` holds no run."""
    if keep < 1:
        raise ValueError(f"keep_previous: keep {keep} must be at least 1")
    if not holds_a_run(out):
        return []
    said = []
    if previous(out, keep).exists():
        shutil.rmtree(previous(out, keep))
        said.append(f"removed {previous(out, keep)}, the oldest run kept (--keep-previous {keep})")
    for index in range(keep - 1, 0, -1):
        if previous(out, index).exists():
            previous(out, index).rename(previous(out, index + 1))
    out.rename(previous(out, 1))
    said.append(f"moved the previous run in {out} to {previous(out, 1)}")
    return said


def record_in(path: pathlib.Path) -> pathlib.Path:
    """The record a record command reads for `path`: the file itself, or a run directory's
    ``record.json``; a directory whose run wrote no record is refused (RecordError) naming
    the file that says why, never read as a verdict."""
    if not path.is_dir():
        return path
    if (path / RECORD).exists():
        return path / RECORD
    said = unfinished.read_summary(path) or harness_error.read_summary(path)
    if said is not None:
        raise RecordError(f"{path}: its run left no record: {said}")
    raise RecordError(f"{path}: a directory without a {RECORD} (not a run's --out)")
