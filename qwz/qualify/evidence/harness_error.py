"""HARNESS-ERROR: the harness could not observe the subject, so the subject was not judged.

[Note: harness errors]
A check judges the subject; a run in which the harness itself could not read the subject
(its seam met a DeepSpeed optimizer without what it reads, [Note: reading DeepSpeed by
capability] in qwz/integrations/deepspeed/structure.py) has no evidence about the subject
either way, so it must not end FAIL (a subject's verdict) nor become a crash record whose
checks blame the arms. Such a run ends ``HARNESS-ERROR`` with its own exit code,
:data:`HARNESS_ERROR_EXIT` ([Note: exit statuses] in qualify/base/exit_codes.py), and
instead of a record writes ``harness-error.json`` in ``--out``: what the harness needed (the
error's message), the rank and where it was, and the subject's identity -- its version
(a checkout's real one) and commit -- beside the harness's own head. A stale ``record.json``
or ``report.md`` of an earlier run in that directory is removed, so no verdict sits beside it.

Most of what would make a harness error is found before any rank starts
(qualify/run/seam_check.py refuses it, exit 2); this is what a rank meets anyway. ``bisect``
treats the exit as a skip (the commit cannot be judged), ``matrix`` as its own cell status.

[Note: cannot run on this runner]
The other way a subject goes unjudged: it needs what the runner lacks -- DeepSpeed's quantizer
op, a CUDA kernel, on a machine without CUDA with the harness's CPU implementation of it turned
off ([Note: a CUDA-only subject on a CPU runner], qualify/run/quantizer_op.py). The rank raises
``RunnerLacksCapability``; the run ends ``CANNOT-RUN`` with exit :data:`CANNOT_RUN_EXIT`,
written the same way (``harness-error.json``, its ``verdict`` says which), never the
subject's FAIL. ``bisect`` skips such a commit, as it skips a harness error.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from qwz.qualify.base import exit_codes
from qwz.qualify.base.rank_reports import RankEnd

HARNESS_ERROR = "HARNESS-ERROR"
HARNESS_ERROR_EXIT = exit_codes.HARNESS_ERROR
FILE_NAME = "harness-error.json"
CANNOT_RUN = "CANNOT-RUN"
CANNOT_RUN_EXIT = exit_codes.CANNOT_RUN_HERE
CANNOT_RUN_TYPES = ("RunnerLacksCapability",)
"""Exception types of a subject that needs what this runner lacks ([Note: cannot run on this
runner])."""
UNJUDGED_EXITS = {4: HARNESS_ERROR, CANNOT_RUN_EXIT: CANNOT_RUN}
"""The exits of a run that judged nothing, and their verdicts."""
HARNESS_ERROR_TYPES = ("SeamError", "DeepSpeedSourceError")
"""Exception types (by name: a rank reports ``Type: message``) that are the harness's failure
to observe the subject, never the subject's: the seam cannot read its optimizer
(qwz/integrations/deepspeed/structure.py), or a rank imported another DeepSpeed than the
subject (qualify/run/subjects.py, [Note: subject identity])."""


def _raised(cause: RankEnd) -> str | None:
    if cause.how != "raised" or not cause.error:
        return None
    return cause.error.partition(":")[0].strip()


def is_harness_error(cause: RankEnd) -> bool:
    """Whether the rank that failed first failed because the harness could not observe."""
    return _raised(cause) in HARNESS_ERROR_TYPES


def is_cannot_run(cause: RankEnd) -> bool:
    """Whether the rank that failed first needed what this runner lacks ([Note: cannot run
    on this runner])."""
    return _raised(cause) in CANNOT_RUN_TYPES


def unjudged(cause: RankEnd) -> tuple[str, int] | None:
    """(verdict, exit code) where the failure judged nothing of the subject, else None."""
    if is_harness_error(cause):
        return HARNESS_ERROR, HARNESS_ERROR_EXIT
    if is_cannot_run(cause):
        return CANNOT_RUN, CANNOT_RUN_EXIT
    return None


def report(
    cause: RankEnd,
    subject_name: str,
    invocation: dict[str, Any] | None,
    verdict: str = HARNESS_ERROR,
) -> dict:
    """The content of ``harness-error.json`` ([Note: harness errors]; `verdict` CANNOT-RUN:
    [Note: cannot run on this runner])."""
    from qwz.qualify.evidence import provenance

    needed = (cause.error or "").partition(":")[2].strip()
    return {
        "verdict": verdict,
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
    from qwz.qualify.base.files import atomic_write_text

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
    who = f"{subject.get('name')} {subject.get('version')} {at} (rank {content.get('rank')})"
    if content.get("verdict") == CANNOT_RUN:
        return f"{CANNOT_RUN}: {who}: {content.get('needed')}"
    return f"{HARNESS_ERROR}: the harness could not observe {who}: {content.get('needed')}"


def read_summary(out: pathlib.Path) -> str | None:
    """:func:`summary` of ``out/harness-error.json``, None when there is none (or unreadable)."""
    try:
        content = json.loads((out / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return summary(content) if isinstance(content, dict) else None
