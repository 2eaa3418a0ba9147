"""HARNESS-ERROR: the harness could not observe the subject, so the subject was not judged.

[Note: harness errors]
A check judges the subject; a run in which the harness itself could not read the subject
(its seam met a DeepSpeed optimizer without what it reads, [Note: reading DeepSpeed by
capability] in qwz/integrations/deepspeed/structure.py) has no evidence about the subject
either way, so it must not end FAIL (a subject's verdict) nor become a crash record whose
checks blame the arms. Such a run ends ``HARNESS-ERROR`` with its own exit code,
:data:`HARNESS_ERROR_EXIT` ([Note: exit statuses] in qualify/exit_codes.py), and
instead of a record writes ``harness-error.json`` in ``--out``: what the harness needed (the
error's message), the rank and where it was, and the subject's identity -- its version
(a checkout's real one) and commit -- beside the harness's own head. A stale ``record.json``
or ``report.md`` of an earlier run in that directory is removed, so no verdict sits beside it.

Most of what would make a harness error is found before any rank starts
(qualify/run/seam_check.py refuses it, exit 2); this is what a rank meets anyway. ``bisect``
treats the exit as a skip (the commit cannot be judged), ``matrix`` as its own cell status.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from qwz.qualify import exit_codes
from qwz.qualify.rank_reports import RankEnd

HARNESS_ERROR = "HARNESS-ERROR"
HARNESS_ERROR_EXIT = exit_codes.HARNESS_ERROR
FILE_NAME = "harness-error.json"
HARNESS_ERROR_TYPES = ("SeamError", "DeepSpeedSourceError")
"""Exception types (by name: a rank reports ``Type: message``) that are the harness's failure
to observe the subject, never the subject's: the seam cannot read its optimizer
(qwz/integrations/deepspeed/structure.py), or a rank imported another DeepSpeed than the
subject (qualify/run/subjects.py, [Note: subject identity])."""


def is_harness_error(cause: RankEnd) -> bool:
    """Whether the rank that failed first failed because the harness could not observe."""
    if cause.how != "raised" or not cause.error:
        return False
    return cause.error.partition(":")[0].strip() in HARNESS_ERROR_TYPES


def report(cause: RankEnd, subject_name: str, invocation: dict[str, Any] | None) -> dict:
    """The content of ``harness-error.json`` ([Note: harness errors])."""
    from qwz.qualify.evidence import provenance

    needed = (cause.error or "").partition(":")[2].strip()
    return {
        "verdict": HARNESS_ERROR,
        "needed": needed,
        "error": cause.error,
        "rank": cause.rank,
        "where": cause.where,
        "traceback": list(cause.traceback),
        **provenance.code_under_test(subject_name),
        "invocation": invocation,
    }


def write(out: pathlib.Path, content: dict) -> pathlib.Path:
    """Write `content` as ``out/harness-error.json``; remove a stale record and report."""
    from qwz.qualify.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    for stale in ("record.json", "report.md"):
        (out / stale).unlink(missing_ok=True)
    path = out / FILE_NAME
    atomic_write_text(path, json.dumps(content, indent=2, default=str) + "\n")
    return path


def summary(content: dict) -> str:
    """One line: the verdict, what the harness needed, and the subject's version and commit."""
    subject = content.get("subject") or {}
    sha = subject.get("sha")
    dirty = " (dirty)" if subject.get("dirty") else ""
    at = f"at {sha[:12]}{dirty}" if sha else "(not a git checkout)"
    return (
        f"{HARNESS_ERROR}: the harness could not observe {subject.get('name')} "
        f"{subject.get('version')} {at} (rank {content.get('rank')}): {content.get('needed')}"
    )


def read_summary(out: pathlib.Path) -> str | None:
    """:func:`summary` of ``out/harness-error.json``, None when there is none (or unreadable)."""
    try:
        content = json.loads((out / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return summary(content) if isinstance(content, dict) else None
