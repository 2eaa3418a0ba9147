"""How one test file's pytest ended: its plugin's events (pytest_plugin/qwz_own_tests_log.py)
and the process's end, read into a :class:`~qwz.qualify.review.own_tests_section.FileRun`: each
test's outcome, the test that was running when the file hit its limit (a hang), died or stopped
pytest, and whose doing the end was ([Note: own tests in the claims table] in
qualify/review/own_tests_section.py)."""

from __future__ import annotations

import json
import pathlib
import re
import signal
from typing import NamedTuple

from qwz.qualify.review import own_tests_section as results
from qwz.qualify.review.own_tests_section import FileRun, TestResult


class Ended(NamedTuple):
    """How the file's pytest process ended."""

    code: int
    """pytest's exit status; -N when signal N ended it."""
    at_limit: str | None
    """"file" (its own limit) or "total" (``--pr-tests-timeout``) when killed at that limit."""
    stopped: bool
    """The review's own SIGINT/SIGTERM ended it."""
    wall_s: float
    limit_s: float
    """The limit it ran under."""


def read_events(path: pathlib.Path) -> list[dict]:
    """The plugin's events; a line torn by a kill, or none at all, is no event."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


_MISSING_MODULE = re.compile(r"No module named '([^']+)'")


def _lacked_modules(messages: list[str], worktree: pathlib.Path, path: str) -> list[str] | None:
    """The modules this runner lacks when every message is a missing module that is not the
    checkout's own (``deepspeed``, the tests' helpers); None when any is something else."""
    roots = [worktree, worktree / "tests", *(worktree / path).parents]
    lacked = []
    for message in messages:
        found = _MISSING_MODULE.search(message)
        if found is None:
            return None
        top = found.group(1).split(".")[0]
        if any((root / top).exists() or (root / f"{top}.py").exists() for root in roots):
            return None  # the checkout's own module: the PR's doing
        lacked.append(top)
    return sorted(set(lacked))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "nothing on its output"


def _process_end(events: list[dict], ended: Ended, output: str) -> tuple[str, str] | None:
    """The file's end when the process, not a test, decided it (a limit, a signal, pytest
    itself); None otherwise."""
    collected = any(event["event"] == "collected" for event in events)
    if ended.stopped:
        return results.INTERRUPTED, "stopped by the review's signal"
    if ended.at_limit == "file":
        where = "" if collected else " while collecting"
        return results.HANG, (
            f"no end within the file's limit of {ended.limit_s:.0f} s{where} "
            "(--pr-tests-file-timeout)"
        )
    if ended.at_limit == "total":
        return results.OVER_TOTAL, (
            "killed when the step's total limit (--pr-tests-timeout) was spent, "
            f"{ended.limit_s:.0f} s into it"
        )
    internal = [event["message"] for event in events if event["event"] == "internal-error"]
    if internal or ended.code == 3:
        said = internal[0] if internal else _last_line(output)
        return results.FILE_HARNESS_ERROR, f"pytest's internal error: {said}"
    if ended.code < 0:
        return results.CRASHED, f"pytest died by {signal.Signals(-ended.code).name}"
    return None


def _collection_end(events, ended: Ended, output: str, worktree, path) -> tuple[str, str] | None:
    """The file's end when it did not get through collection; None when it did."""
    errors = [event for event in events if event["event"] == "collect-error"]
    if errors:
        lacked = _lacked_modules([event["message"] for event in errors], worktree, path)
        if lacked:
            return results.CANNOT_RUN, f"this runner lacks {', '.join(lacked)}, which it imports"
        said = "; ".join(
            event["message"]
            if event["nodeid"] in ("", path)
            else f"{event['nodeid']}: {event['message']}"
            for event in errors
        )
        return results.NOT_COLLECTED, said
    if any(event["event"] == "collected" for event in events):
        return None
    if "while loading conftest" in output:  # the head's conftest does not import
        return results.NOT_COLLECTED, f"its conftest does not load: {_last_line(output)}"
    if ended.code == 4:
        return results.FILE_HARNESS_ERROR, f"pytest refused its command line: {_last_line(output)}"
    return results.FILE_HARNESS_ERROR, f"pytest exited {ended.code} before collecting: " + (
        _last_line(output)
    )


def _session_end(events: list[dict], ended: Ended, output: str) -> tuple[str, str]:
    """The end of a file that collected and whose process ended by itself."""
    exits = [event["message"] for event in events if event["event"] == "exit"]
    if exits:
        return results.STOPPED, f"pytest.exit: {exits[0]}"
    if ended.code in (0, 1):
        return results.FINISHED, ""
    if ended.code == 5:
        return results.FINISHED, "collected no test"
    return results.FILE_HARNESS_ERROR, f"pytest exited {ended.code}: {_last_line(output)}"


def _finished_outcome(reports: list[dict]) -> tuple[str, str]:
    """The outcome of a test pytest finished (a teardown report), in pytest's terms."""
    for report in reports:
        if report["outcome"] == "failed":
            return (results.FAILED if report["when"] == "call" else results.ERROR), report[
                "message"
            ]
    for report in reports:
        if report["outcome"] == "skipped":
            if "xfail" in report:
                return results.XFAILED, report["xfail"]
            return results.SKIPPED, report["message"]
    call = [report for report in reports if report["when"] == "call"]
    if call and "xfail" in call[0]:
        return results.XPASSED, call[0]["xfail"]
    return results.PASSED, ""


UNFINISHED = {
    results.HANG: "running when the file hit its limit",
    results.CRASHED: "running when pytest died",
    results.STOPPED: "running when pytest stopped",
    results.OVER_TOTAL: "running when the total limit was spent",
    results.INTERRUPTED: "running when the review was stopped",
}
"""The outcome of the test that was running when its file ended so, and what it says."""


def _from_root(nodeid: str, rootdir: pathlib.Path | None, worktree: pathlib.Path) -> str:
    """A node id relative to the repository's root (pytest's is relative to its rootdir,
    ``tests/`` where DeepSpeed's ``tests/pytest.ini`` is)."""
    if rootdir is None or not nodeid:
        return nodeid
    path, sep, rest = nodeid.partition("::")
    try:
        path = (rootdir / path).relative_to(worktree).as_posix()
    except ValueError:
        return nodeid
    return path + sep + rest


def _normalized(events: list[dict], worktree: pathlib.Path) -> list[dict]:
    """The events with every node id relative to the repository's root."""
    roots = [event["path"] for event in events if event["event"] == "rootdir"]
    rootdir = pathlib.Path(roots[0]).resolve() if roots else None
    base = worktree.resolve()
    normalized = []
    for event in events:
        event = dict(event)
        if "nodeid" in event:
            event["nodeid"] = _from_root(event["nodeid"], rootdir, base)
        if "nodeids" in event:
            event["nodeids"] = [_from_root(nodeid, rootdir, base) for nodeid in event["nodeids"]]
        normalized.append(event)
    return normalized


def _tests(events: list[dict], end: str, detail: str) -> tuple[TestResult, ...]:
    reports: dict[str, list[dict]] = {}
    started: list[str] = []
    collected: list[str] = []
    deselected: list[str] = []
    for event in events:
        kind = event["event"]
        if kind == "report":
            reports.setdefault(event["nodeid"], []).append(event)
        elif kind == "start":
            started.append(event["nodeid"])
        elif kind == "collected":
            collected = list(event["nodeids"])
        elif kind == "deselected":
            deselected += event["nodeids"]
    found = []
    for nodeid in dict.fromkeys([*collected, *started]):
        mine = reports.get(nodeid, [])
        seconds = round(sum(float(report.get("seconds", 0.0)) for report in mine), 3)
        if any(report["when"] == "teardown" for report in mine):
            outcome, reason = _finished_outcome(mine)
        elif nodeid in started and end in UNFINISHED:
            outcome, reason = end, f"{UNFINISHED[end]}: {detail}"
        else:
            outcome, reason = results.NOT_REACHED, f"not run: its file ended first ({end})"
        found.append(TestResult(nodeid, outcome, reason, seconds))
    reason = "deselected by the head's pytest options"
    found += [TestResult(nodeid, results.DESELECTED, reason, 0.0) for nodeid in deselected]
    return tuple(found)


def _runner_lacks(tests: tuple[TestResult, ...], worktree, path) -> tuple[TestResult, ...]:
    """A test that failed only for a module this runner lacks (not the checkout's own) is
    not the PR's failure: it cannot run here."""
    found = []
    for test in tests:
        lacked = None
        if test.outcome in (results.FAILED, results.ERROR):
            lacked = _lacked_modules([test.reason], worktree, path)
        if lacked:
            test = test._replace(
                outcome=results.CANNOT_RUN, reason=f"this runner lacks {', '.join(lacked)}"
            )
        found.append(test)
    return tuple(found)


def file_run(
    path: str,
    events: list[dict],
    ended: Ended,
    output: str,
    worktree: pathlib.Path,
    outputs: dict[str, str],
) -> FileRun:
    """The file's :class:`FileRun`: how it ended and each test's outcome (module docstring);
    `output` is pytest's stdout and stderr, `outputs` its files and their sha256."""
    events = _normalized(events, worktree)
    end = (
        _process_end(events, ended, output)
        or _collection_end(events, ended, output, worktree, path)
        or _session_end(events, ended, output)
    )
    collected = any(event["event"] == "collected" for event in events) and not any(
        event["event"] == "collect-error" for event in events
    )
    tests = _runner_lacks(_tests(events, *end), worktree, path)
    return FileRun(
        path, end[0], end[1], ended.code, round(ended.wall_s, 1), collected, tests, outputs
    )
