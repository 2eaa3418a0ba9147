"""A run's files, from what its ranks left: the plots, report and record of a verdict; where
there is none, the file that says why -- ``harness-error.json`` ([Note: harness errors] in
qualify/evidence/harness_error.py), ``timed-out.json`` or ``interrupted.json`` ([Note:
unfinished runs] in qualify/evidence/unfinished.py) -- each replacing an earlier run's
([Note: results kept] in qualify/evidence/run_dir.py); and the line ``run`` prints of each.
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any, Protocol

from qwz.qualify.base import exit_codes
from qwz.qualify.review import outputs


class RunUnderWay(Protocol):
    """A run preflight accepted, as its files are written from it (the CLI's run)."""

    plan: Any
    world_size: int
    invocation: dict
    out: pathlib.Path
    started_s: float
    """time.monotonic() when the request was accepted (durations)."""
    started_at: float
    """time.time() then (file times)."""
    phase: str
    """What it is doing now, for interrupted.json."""


def write_failure(
    failure, run: RunUnderWay, conformance: dict | None = None, *, limit_known: bool = True
) -> int:
    """A rank raised, died or hung ([Note: failures] in qualify/run/runner.py): the evidence
    is a FAIL record naming the rank that failed first, the arm and the step; or no verdict:
    where the harness could not observe the subject ([Note: harness errors]), or where the
    run's own time limit ran out ([Note: unfinished runs])."""
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.evidence import harness_error, run_dir

    plan, out, invocation = run.plan, run.out, run.invocation
    print(f"qwz-qualify: the ranks failed: {failure}", file=sys.stderr)
    if failure.cause is None:
        raise failure
    if failure.cause.how == "timeout" and limit_known and failure.limit_s is not None:
        return _write_timed_out(failure, run)
    unjudged = harness_error.unjudged(failure.cause)
    if unjudged is not None:
        verdict, exit_code = unjudged
        content = harness_error.report(failure.cause, plan.subject, invocation, verdict)
        path = harness_error.write(out, content)
        run_dir.remove_stale(out, [harness_error.FILE_NAME])
        print(f"wrote {path}; {harness_error.summary(content)}")
        return exit_code
    built = evidence.build_failure_record(
        plan,
        run.world_size,
        failure.cause,
        failure.context,
        failure.results,
        invocation,
        conformance,
    )
    return write_evidence(built, out)


def _write_timed_out(failure, run: RunUnderWay) -> int:
    """[Note: unfinished runs]: ``timed-out.json``, its own verdict naming the limit; exit 3."""
    from qwz.qualify.evidence import unfinished

    limit_s = failure.limit_s
    ends = [failure.cause, *failure.context]
    progress = unfinished.progress(
        [arm.name for arm in run.plan.arms],
        {rank: list(kept) for rank, kept in failure.results.items()},
        {end.rank: end.where for end in ends},
    )
    seconds = time.monotonic() - run.started_s
    content = unfinished.timed_out(limit_s, progress, seconds, run.invocation)
    _write_unfinished(run.out, unfinished.TIMED_OUT_FILE, content)
    return exit_codes.INCONCLUSIVE


def write_interrupted(interrupted, run: RunUnderWay) -> None:
    """[Note: unfinished runs]: ``interrupted.json``, what ran and what did not; nothing where
    the signal came after this run's record was written (the run is done: it is kept)."""
    from qwz.qualify.evidence import run_dir, unfinished

    record = run.out / run_dir.RECORD
    if record.is_file() and record.stat().st_mtime >= run.started_at:
        return
    finished, where = interrupted.ranks or ({}, {})
    progress = unfinished.progress([arm.name for arm in run.plan.arms], finished, where)
    seconds = time.monotonic() - run.started_s
    content = unfinished.interrupted(
        interrupted.signal_name, run.phase, progress, seconds, run.invocation
    )
    _write_unfinished(run.out, unfinished.INTERRUPTED_FILE, content)


def _write_unfinished(out: pathlib.Path, name: str, content: dict) -> None:
    from qwz.qualify.evidence import run_dir, unfinished

    path = unfinished.write(out, name, content)
    run_dir.remove_stale(out, [name])
    print(f"wrote {path}; {unfinished.summary(content)}")


def write_evidence(built, out: pathlib.Path) -> int:
    """The plots, the report and the record of a run in `out`; the run's exit code."""
    from qwz.qualify.evidence import run_dir, signing

    key = signing.configured_key()  # usable: preflight tried it
    if key is not None:
        built = built.model_copy(update={"signature": signing.sign(built.digest, key)})
    # Plots, then the report, then the record, each atomically: a run cut short leaves
    # no record.json, or the previous one, never a partial one (qwz.qualify.base.files); a
    # plot that fails costs neither ([Note: nothing lost after a run], review/outputs.py).
    plots = outputs.write_run_outputs(built, out, key, signature_section(built, key)).plots
    # An earlier run's files, now moot ([Note: results kept]): its plots that this run
    # did not draw, a harness-error.json or timed-out.json.
    run_dir.remove_stale(out, [run_dir.RECORD, run_dir.REPORT, *plots.values()])
    verdict = built.verdict
    status = verdict.status
    if verdict.failed:
        status += ": " + ", ".join(verdict.failed)
    elif verdict.inconclusive:
        status += ": " + ", ".join(verdict.inconclusive)
    print(f"wrote {out / 'record.json'}, {out / 'report.md'} and {len(plots)} plots; {status}")
    for op in built.subject.substituted_ops:
        print(f"substituted: {op}")
    scheme = outputs.scheme_sentence(built)
    if scheme:
        print(f"scheme: {scheme}")
    return exit_codes.VERDICT_EXITS[verdict.status]


def signature_section(built, key) -> str:
    """The markdown a report ends with: signed or unsigned, by which key, verified?"""
    from qwz.qualify.evidence.signing import describe

    return f"\n## Signature\n\n{describe(built.digest, built.signature, key)}\n"
