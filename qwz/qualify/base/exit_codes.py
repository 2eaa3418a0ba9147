"""One meaning per exit status, for every ``qwz-qualify`` command.

[Note: exit statuses]
A CI job acts on the exit status alone, so each status means one thing whichever command
gives it, and every command's ``--help`` prints this table (:func:`epilog`):

  0    PASS: the subject passed (``compare``: no regression; ``bisect``: the first bad commit
       was found; ``report``, ``history``, ``promote``: done)
  1    FAIL: the subject failed (a check failed, an arm diverged, a rank crashed;
       ``compare``: a regression)
  2    refused: the request is wrong or cannot be served, said in one line per problem,
       before any rank starts where that is knowable (a bad flag, a file that cannot be read
       or written, a record that cannot be trusted, a baseline that would be replaced without
       ``--force``, ``bisect``'s bad head that is not bad)
  3    INCONCLUSIVE: no verdict on the subject could be reached (the reference did not learn;
       the run's ``--timeout`` ran out, ``timed-out.json``; ``bisect``: skipped commits hide
       the answer)
  4    HARNESS-ERROR: the harness failed (it could not observe the subject,
       ``harness-error.json``; or a bug in qwz-qualify), never the subject's FAIL
  5    CANNOT-RUN: the subject needs a capability this runner lacks (its quantizer op needs
       CUDA and ``--no-cpu-quantizer`` turned the harness's CPU implementation off, ...),
       ``harness-error.json`` with verdict CANNOT-RUN; never the subject's FAIL
  130  interrupted by SIGINT (``run`` writes ``interrupted.json``: what ran, what did not;
       no verdict)
  141  the reader of the output went away (``qwz-qualify report ... | head -1``): the command
       stops quietly, as a tool killed by SIGPIPE does
  143  interrupted by SIGTERM (as 130)

``bisect-step`` alone speaks ``git bisect run``'s protocol instead (0 good, 1 bad, 125 skip,
128 abort), since git reads its status.
"""

from __future__ import annotations

import signal

PASS = 0
FAIL = 1
REFUSED = 2
INCONCLUSIVE = 3
HARNESS_ERROR = 4
CANNOT_RUN_HERE = 5
"""The subject needs a capability this runner lacks (e.g. its quantizer op needs CUDA);
never the subject's FAIL."""
INTERRUPTED_SIGINT = 128 + signal.SIGINT  # 130
INTERRUPTED_SIGTERM = 128 + signal.SIGTERM  # 143
OUTPUT_CLOSED = 128 + signal.SIGPIPE  # 141

VERDICT_EXITS = {"PASS": PASS, "FAIL": FAIL, "INCONCLUSIVE": INCONCLUSIVE}
"""A record's verdict -> the exit status of the command that wrote or judged it."""

MEANINGS = {
    PASS: "PASS (compare: no regression; bisect: found; other commands: done)",
    FAIL: "FAIL: the subject failed (compare: a regression)",
    REFUSED: "refused: a usage, file or trust problem, one line each on stderr",
    INCONCLUSIVE: "INCONCLUSIVE: no verdict reached (timed-out.json: --timeout ran out)",
    HARNESS_ERROR: "HARNESS-ERROR: the harness failed, not the subject",
    CANNOT_RUN_HERE: "CANNOT-RUN: the subject needs what this runner lacks (a CUDA op, ...)",
    INTERRUPTED_SIGINT: "interrupted by SIGINT (run: interrupted.json, no verdict)",
    OUTPUT_CLOSED: "the reader of stdout went away (| head): stopped quietly",
    INTERRUPTED_SIGTERM: "interrupted by SIGTERM (run: interrupted.json, no verdict)",
}
"""Every exit status any command gives (but ``bisect-step``), with its one meaning."""

GIT_BISECT_GOOD, GIT_BISECT_BAD, GIT_BISECT_SKIP, GIT_BISECT_ABORT = 0, 1, 125, 128
"""``bisect-step``'s statuses: ``git bisect run``'s protocol, which git reads."""
GIT_BISECT_STEP = "0 good, 1 bad, 125 skip, 128 abort (git bisect run's protocol)"


def epilog(command: str | None = None) -> str:
    """The exit-status table every ``--help`` ends with ([Note: exit statuses]); the help
    formatter keeps its lines."""
    if command == "bisect-step":
        return f"exit status ({command} is a `git bisect run` command): {GIT_BISECT_STEP}"
    rows = "\n".join(f"  {code:<4} {meaning}" for code, meaning in MEANINGS.items())
    return f"exit status, the same for every qwz-qualify command:\n{rows}"
