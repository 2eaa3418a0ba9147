"""The PR's own tests as the review reports them: their outcomes at the head (and, as context,
the head's test files on the base's code), the two claims-table rows, the line beside the
verdict and the report's section (qualify/pr_review/own_tests.py runs them).

[Note: own tests in the claims table]
Two rows, decided by the head alone: "the PR's own tests collect at its head" (every file
imports and collects, under the head's own conftest) and "the PR's own tests pass at its
head" (every test that ran passed). FAIL names what failed: a failing or erring test, a file
that does not collect, a hang (a file killed at its own time limit, the test that was running
named), a test that stopped pytest or whose process died. Skipped and deselected tests are
listed as not run with their reasons, never counted as passed; a head whose tests all skip
decides nothing (INCONCLUSIVE: nothing vacuous passes). What is not the subject's doing is
never its FAIL: the total limit spent (``--pr-tests-timeout``: INCONCLUSIVE, the limit named),
a third-party module the runner lacks, at import or in a test (INCONCLUSIVE: cannot run on
this runner), pytest's own internal or usage error (HARNESS-ERROR). The base's outcomes are
context only: a test that passes on the base's code too proves nothing new about the change,
and the row says so. A review without the step (``--no-pr-tests``) or of a PR that changes no
test says so in the rows, which then decide nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from qwz.qualify.evidence.harness_error import HARNESS_ERROR
from qwz.qualify.review.claims import FAIL, INCONCLUSIVE, PASS, ClaimRow
from qwz.qualify.review.formatting import table

COLLECT_CLAIM = "the PR's own tests collect at its head"
PASS_CLAIM = "the PR's own tests pass at its head"
NOT_RUN = "not run"
"""A row's verdict when the step did not run (``--no-pr-tests``, a refused or stopped review)."""
NO_TESTS = "no tests"
"""A row's verdict for a PR that changes no test file."""

# A test's outcome: pytest's words, and the review's for a test pytest never finished.
PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
XFAILED, XPASSED, DESELECTED = "xfailed", "xpassed", "deselected"
HANG, CRASHED, STOPPED = "hang", "crashed", "stopped"
"""The test running when its file hit its own limit / when pytest died / when it called
``pytest.exit`` (DeepSpeed's ``DistributedTest`` does on its own timeout)."""
NOT_REACHED, OVER_TOTAL, INTERRUPTED = "not reached", "total limit", "interrupted"
"""Never ran (its file ended first) / running when ``--pr-tests-timeout`` was spent / running
when the review was stopped."""
CANNOT_RUN = "cannot run here"
"""A test, or a file, that failed only for a module this runner lacks (not the checkout's)."""
FAILING = (FAILED, ERROR, HANG, CRASHED, STOPPED)
UNDECIDED = (OVER_TOTAL, INTERRUPTED, CANNOT_RUN)
NOT_RUN_OUTCOMES = (SKIPPED, DESELECTED)

# How a file's pytest ended (FileRun.ended).
FINISHED, NOT_COLLECTED = "finished", "does not collect"
FILE_HARNESS_ERROR, FILE_NOT_RUN = "harness error", "not run"
FILE_ENDS_SUBJECT = (NOT_COLLECTED, HANG, CRASHED, STOPPED)
"""A file's ends that are the subject's doing (FAIL)."""
FILE_ENDS_UNDECIDED = (CANNOT_RUN, OVER_TOTAL, FILE_NOT_RUN, INTERRUPTED)


class TestResult(NamedTuple):
    test: str
    """pytest's node id, relative to the repository's root (``tests/unit/x.py::test_y``)."""
    outcome: str
    reason: str
    """Why it is not a plain pass: the skip's reason, the failure's exception line."""
    seconds: float


class FileRun(NamedTuple):
    """One test file's pytest process and what it found."""

    path: str
    ended: str
    """FINISHED, NOT_COLLECTED, HANG, CRASHED, STOPPED, CANNOT_RUN, OVER_TOTAL, FILE_NOT_RUN,
    INTERRUPTED or FILE_HARNESS_ERROR."""
    detail: str
    exit_code: int | None
    wall_s: float
    collected: bool
    """pytest collected the file without an error."""
    tests: tuple[TestResult, ...]
    outputs: dict[str, str]
    """Its files, relative to the review's directory, -> their sha256: the JUnit XML (pytest's
    own), the event log and the output."""


class SideTests(NamedTuple):
    """The test files at one side, as run in the review's worktree."""

    side: str
    """"head" or "base" (the head's test files on the base's code)."""
    sha: str
    """The commit checked out when they ran (read back from the worktree)."""
    tests_from: str
    """The commit the test files came from: the head's, at both sides."""
    files: tuple[FileRun, ...]
    kind: str = "ran"
    """"ran" (now) or "resumed" (a finished result of the same request, reused)."""


class OwnTests(NamedTuple):
    status: str
    """"ran", NOT_RUN, NO_TESTS, or HARNESS-ERROR (the worktree could not be made)."""
    reason: str
    how: str
    """How the files were found: the diff, or ``--pr-tests``."""
    test_files: tuple[str, ...]
    other_files: tuple[str, ...]
    head: SideTests | None = None
    base: SideTests | None = None
    limits: dict[str, float] | None = None
    """``file_s`` (each file) and ``total_s`` (the step), in seconds."""


def not_run(reason: str, how: str = "", test_files=(), other_files=()) -> OwnTests:
    return OwnTests(NOT_RUN, reason, how, tuple(test_files), tuple(other_files))


# ------------------------------------------------------------------------------ verdicts
def _worst(verdicts: list[str]) -> str:
    for verdict in (FAIL, HARNESS_ERROR, INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return PASS


def _file_verdict(run: FileRun) -> str:
    if run.ended in FILE_ENDS_SUBJECT:
        return FAIL
    if run.ended == FILE_HARNESS_ERROR:
        return HARNESS_ERROR
    return INCONCLUSIVE if run.ended in FILE_ENDS_UNDECIDED else PASS


def collect_verdict(head: SideTests) -> str:
    """FAIL where a file does not collect or hangs while collecting; else the worst of the
    files that did not get through collection; else PASS."""
    verdicts = [
        FAIL if run.ended == NOT_COLLECTED else _file_verdict(run)
        for run in head.files
        if not run.collected
    ]
    return _worst(verdicts)


def tests_verdict(head: SideTests) -> str:
    """[Note: own tests in the claims table]: FAIL for a failing test or file, else the
    worst of the files' ends, else INCONCLUSIVE when no test passed, else PASS."""
    outcomes = [test.outcome for run in head.files for test in run.tests]
    verdicts = [_file_verdict(run) for run in head.files]
    if any(outcome in FAILING for outcome in outcomes):
        verdicts.append(FAIL)
    if PASSED not in outcomes or any(outcome in UNDECIDED for outcome in outcomes):
        verdicts.append(INCONCLUSIVE)
    return _worst(verdicts)


def verdict(own: OwnTests) -> str:
    """The step's verdict: the worse of its two rows (NOT_RUN or NO_TESTS without them)."""
    if own.head is None:
        return own.status
    return _worst([collect_verdict(own.head), tests_verdict(own.head)])


# ------------------------------------------------------------------------------- text
def counts(head: SideTests) -> str:
    """The head's tests counted: passed, failed, errors, skipped (not run), then any other
    outcome that occurred."""
    found = Counter(test.outcome for run in head.files for test in run.tests)
    text = (
        f"{found[PASSED]} passed, {found[FAILED]} failed, {found[ERROR]} errors, "
        f"{found[SKIPPED]} skipped (not run)"
    )
    others = [
        f"{found[name]} {name}" for name in found if name not in (PASSED, FAILED, ERROR, SKIPPED)
    ]
    return text + "".join(f", {other}" for other in others)


def _not_run_text(head: SideTests) -> str:
    """Tests skipped or deselected, grouped by their reason."""
    reasons: dict[str, list[str]] = {}
    for run in head.files:
        for test in run.tests:
            if test.outcome in NOT_RUN_OUTCOMES:
                why = f"{test.outcome}: {test.reason or 'no reason given'}"
                reasons.setdefault(why, []).append(test.test)
    return "; ".join(f"not run, {why}: {', '.join(tests)}" for why, tests in reasons.items())


def _problems(head: SideTests) -> list[str]:
    """What kept the head from PASS, the subject's first: each failing test and file."""
    lines = [
        f"{test.outcome} {test.test}" + (f" ({test.reason})" if test.reason else "")
        for run in head.files
        for test in run.tests
        if test.outcome in (*FAILING, *UNDECIDED)
    ]
    lines += [
        f"{run.path} {run.ended}: {run.detail}"
        for run in head.files
        if run.detail and not any(test.outcome in FAILING for test in run.tests)
    ]
    return lines


def _at_base(own: OwnTests, test: str) -> str:
    """The test's outcome on the base's code; for a file that ran there but did not finish,
    "file <how it ended>"; "not at the base" for a file the base lacks."""
    if own.base is None:  # no test file of the head exists at the base
        return "not at the base"
    path = test.split("::")[0]
    runs = [run for run in own.base.files if run.path == path]
    if not runs:
        return "not at the base"
    found = [t.outcome for t in runs[0].tests if t.test == test]
    return found[0] if found else f"file {runs[0].ended}"


def _tests_the_change(at_base: str) -> bool:
    """Whether a test that passes at the head fails (or cannot run) on the base's code."""
    return at_base in FAILING or at_base.removeprefix("file ") in FILE_ENDS_SUBJECT


def _base_context(own: OwnTests) -> str:
    """What the head's tests did on the base's code: context, never the verdict."""
    if own.base is None or own.head is None:
        return ""
    passed = [t.test for run in own.head.files for t in run.tests if t.outcome == PASSED]
    at_base = {test: _at_base(own, test) for test in passed}
    also = [test for test, outcome in at_base.items() if outcome == PASSED]
    changed = [test for test, outcome in at_base.items() if _tests_the_change(outcome)]
    new_files = [
        run.path
        for run in own.head.files
        if run.path not in {base_run.path for base_run in own.base.files}
    ]
    parts = []
    if also:
        parts.append(
            f"{len(also)} pass on the base's code too, proving nothing new about the "
            f"change: {', '.join(also)}"
        )
    if changed:
        parts.append(f"{len(changed)} fail there, so they test the change")
    if new_files:
        parts.append(f"new files, not run at the base: {', '.join(new_files)}")
    return f" [base, the head's test files on the base's code: {'; '.join(parts)}]" if parts else ""


def summary_line(own: OwnTests | None) -> str:
    """The line beside the review's verdict (the report's first page, the console)."""
    if own is None:
        return "The PR's own tests: not part of this review."
    if own.head is None:
        return f"The PR's own tests: {own.status} ({own.reason})."
    head = own.head
    line = (
        f"The PR's own tests at its head `{head.sha[:12]}`: **{verdict(own)}**, "
        f"{counts(head)} in {len(head.files)} file{'s' if len(head.files) != 1 else ''}"
    )
    problems = _problems(head)
    return line + (f"; {'; '.join(problems[:3])}" if problems else "") + "."


def claim_rows(own: OwnTests | None) -> list[ClaimRow]:
    """[Note: own tests in the claims table]; none for a review without the step's data (a
    review written before it existed)."""
    if own is None:
        return []
    if own.head is None:
        row_reason = own.reason
        return [
            ClaimRow(COLLECT_CLAIM, ("pr-tests",), own.status, row_reason),
            ClaimRow(PASS_CLAIM, ("pr-tests",), own.status, row_reason),
        ]
    head = own.head
    collect = collect_verdict(head)
    collected = [run.path for run in head.files if run.collected]
    not_collected = [
        f"{run.path} ({run.ended}: {run.detail})" for run in head.files if not run.collected
    ]
    collect_detail = f"{len(collected)} of {len(head.files)} files collect"
    collect_detail += f"; not: {'; '.join(not_collected)}" if not_collected else ""
    tests = tests_verdict(head)
    detail = counts(head)
    for extra in (_problems(head), [_not_run_text(head)] if _not_run_text(head) else []):
        detail += f"; {'; '.join(extra)}" if extra else ""
    detail += _base_context(own)
    ran = tuple(test.test for run in head.files for test in run.tests)
    return [
        ClaimRow(COLLECT_CLAIM, tuple(run.path for run in head.files), collect, collect_detail),
        ClaimRow(PASS_CLAIM, ran or ("pr-tests",), tests, detail),
    ]


def section_lines(own: OwnTests | None) -> list[str]:
    """The report's section: how the files were found, each test at the head and the base,
    each file's end and outputs."""
    lines = ["## The PR's own tests", ""]
    if own is None or own.head is None:
        return [*lines, summary_line(own), ""]
    lines += [
        f"The test files the PR adds or changes ({own.how}), run with pytest in the review's "
        f"worktree at the head `{own.head.sha}` (DeepSpeed's own conftest, the head's "
        "DeepSpeed importable); at the base, the same files on the base's code where they "
        "exist there: context only.",
        "",
    ]
    if own.other_files:
        lines += [f"Other files changed under tests/: {', '.join(own.other_files)}.", ""]
    rows = [
        (f"`{test.test}`", f"**{test.outcome}**", _at_base(own, test.test), test.reason or "—")
        for run in own.head.files
        for test in run.tests
    ]
    lines += table(("test", "at the head", "at the base", "why"), rows)
    files = [
        (
            side.side,
            f"`{run.path}`",
            run.ended,
            f"{run.wall_s:.0f} s",
            run.detail or "—",
            ", ".join(f"[{name.rsplit('/', 1)[-1]}]({name})" for name in run.outputs) or "—",
        )
        for side in (own.head, own.base)
        if side is not None
        for run in side.files
    ]
    return lines + table(("side", "file", "ended", "time", "detail", "outputs"), files)


# ------------------------------------------------------------------------------ data
def to_data(own: OwnTests | None) -> dict[str, Any] | None:
    if own is None:
        return None
    data = own._asdict()
    for name in ("head", "base"):
        side = getattr(own, name)
        data[name] = None if side is None else side_data(side)
    data["verdict"] = verdict(own)
    return data


def side_data(side: SideTests) -> dict[str, Any]:
    data = side._asdict()
    data["files"] = [
        {**run._asdict(), "tests": [test._asdict() for test in run.tests]} for run in side.files
    ]
    return data


def side_from_data(data: dict[str, Any]) -> SideTests:
    """A :class:`SideTests` from :func:`side_data`; KeyError or TypeError when it is not one."""
    files = tuple(
        FileRun(**{**run, "tests": tuple(TestResult(**test) for test in run["tests"])})
        for run in data["files"]
    )
    return SideTests(**{**data, "files": files})
