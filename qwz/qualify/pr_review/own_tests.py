"""The PR's own tests, run by the review at the exact head beside the independent judge.

[Note: the PR's own tests]
A reviewer's first question is whether the PR's own tests pass at the head under review, on
a runner they trust. The review finds the test files the PR adds or changes
(qualify/pr_review/test_files.py: ``git diff base...head`` under ``tests/``, or
``--pr-tests PATH...``) and runs each with pytest, one process per file, in the review's
worktree (never the user's checkout) at the head: the head's DeepSpeed first on
``PYTHONPATH``, DeepSpeed's own test harness as the head has it (``tests/conftest.py``, its
pytest options, ``tests/unit/common.py``'s ``DistributedTest``, which spawns its ranks), the
op builds in the directory the runs use ([Note: ops of a checkout], qualify/run/subjects.py).
Each file runs under a limit of its own (``--pr-tests-file-timeout``) and all of them within
the step's (``--pr-tests-timeout``); a file over its own limit is a hang of the test that was
running, killed with every process of its session (its ranks too); a file the total limit
cuts is the runner's limit, never the subject's. A small plugin
(pytest_plugin/qwz_own_tests_log.py) logs each test's start and end as they happen, which
is how a killed file still names its running test; pytest's own JUnit XML is kept beside it
for CI reporters, both hashed into the review record with the commit read back from the
worktree. The head's files run first: they decide ([Note: own tests in the claims table],
qualify/review/own_tests_section.py). Then, with what is left of the total limit, the same test
files on the base's code -- the base checked out and every file the PR changed under
``tests/`` put over it -- for each test file that exists at the base: a test that passes
there too proves nothing new about the change. Each side's result is kept
(``pr-tests/<side>.json``) and reused by a resumed review of the same commits, files and
limit, as a finished run is ([Note: review resume]).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from qwz import jsonio
from qwz.qualify.base import supervise
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.base.supervise import Stop
from qwz.qualify.bisect.first_parents import GitError, git
from qwz.qualify.evidence.harness_error import HARNESS_ERROR
from qwz.qualify.pr_review import checkout, test_files, test_log
from qwz.qualify.pr_review.test_files import TestFiles
from qwz.qualify.review import own_tests_section as results
from qwz.qualify.review.own_tests_section import FileRun, OwnTests, SideTests

PLUGIN_DIR = pathlib.Path(__file__).resolve().parent / "pytest_plugin"
PLUGIN = "qwz_own_tests_log"
LOG_ENV = "QWZ_OWN_TESTS_LOG"
OUTPUT_DIR = "pr-tests"
FILE_LIMIT_S = 1200.0
TOTAL_LIMIT_S = 3600.0
DROPPED_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")
"""The runner's own pytest options: the PR's tests run with the head's, not these."""
RERUN_ENDS = (*results.FILE_ENDS_UNDECIDED, results.FILE_HARNESS_ERROR)
"""A file's ends that say nothing of the subject (a limit, a signal, this runner, pytest
itself): a resumed review runs that side again, as it does a test that could not run here."""


class Refused(Exception):
    """The step cannot be served as asked (a path that is no file of the head, no pytest)."""


class Plan(NamedTuple):
    files: TestFiles | None
    """None: ``--no-pr-tests``."""
    file_limit_s: float
    total_limit_s: float


def plan(args, repository: pathlib.Path, base: str, head: str) -> Plan:
    """The step as ``args`` asks for it, checked before anything runs; Refused with why."""
    file_limit_s, total_limit_s = args.pr_tests_file_timeout, args.pr_tests_timeout
    if args.no_pr_tests:
        return Plan(None, file_limit_s, total_limit_s)
    try:
        if args.pr_tests:
            files = test_files.from_paths(repository, head, args.pr_tests)
        else:
            files = test_files.from_diff(repository, base, head)
    except ValueError as error:
        raise Refused(str(error)) from None
    if files.tests and not pytest_available():
        raise Refused(
            f"pytest is not installed for {sys.executable}, which runs the PR's own tests "
            f"({', '.join(files.tests)}): install it (pip install 'pytest>=8'), or pass "
            "--no-pr-tests"
        )
    return Plan(files, file_limit_s, total_limit_s)


def pytest_available() -> bool:
    return importlib.util.find_spec("pytest") is not None


Launcher = Callable[[list[str], dict[str, str], pathlib.Path, pathlib.Path, float, Stop], tuple]
"""Runs ``command`` (env, cwd) with its output in a file for at most ``limit_s`` seconds:
(exit status, killed at the limit) (the seam the unit tests replace)."""


def subprocess_launcher(command, env, cwd, output, limit_s, stop) -> tuple[int, bool]:
    with output.open("w") as out:
        return supervise.run_within(
            command, stop, limit_s, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )


class Context(NamedTuple):
    """Where and how the step runs."""

    repository: pathlib.Path
    worktree: pathlib.Path
    out: pathlib.Path
    stop: Stop
    say: Callable[[str], None]
    launcher: Launcher
    file_limit_s: float
    total_limit_s: float
    deadline: float
    """``time.monotonic()`` when the step's total limit is spent."""


def _environment(worktree: pathlib.Path, log: pathlib.Path) -> dict[str, str]:
    """The runner's environment with the head's DeepSpeed first on the path and the plugin
    last ([Note: the PR's own tests])."""
    from qwz.qualify.run.subjects import extensions_dir

    env = {key: value for key, value in os.environ.items() if key not in DROPPED_ENV}
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join([str(worktree), *paths, str(PLUGIN_DIR)])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(worktree.resolve())))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the worktree stays clean for the next run
    env[LOG_ENV] = str(log)
    return env


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _not_started(path: str, ended: str, detail: str) -> FileRun:
    return FileRun(path, ended, detail, None, 0.0, False, (), {})


def _limit(ctx: Context) -> tuple[float, str] | None:
    """The file's limit and which it is ("file" or "total"); None when none is left."""
    remaining = ctx.deadline - time.monotonic()
    if remaining <= 0:
        return None
    return (ctx.file_limit_s, "file") if ctx.file_limit_s <= remaining else (remaining, "total")


def _run_file(ctx: Context, directory: pathlib.Path, index: int, path: str) -> FileRun:
    """One test file's pytest, in the worktree, under its limit."""
    if ctx.stop.signum is not None:
        return _not_started(path, results.INTERRUPTED, "the review was stopped before it ran")
    limit = _limit(ctx)
    if limit is None:
        why = f"the step's total limit of {ctx.total_limit_s:.0f} s (--pr-tests-timeout) was spent"
        return _not_started(path, results.FILE_NOT_RUN, f"{why} before it started")
    stem = f"{index:02d}-{pathlib.PurePosixPath(path).stem}"
    junit, log, output = (directory / f"{stem}{suffix}" for suffix in (".xml", ".jsonl", ".out"))
    for earlier in (junit, log, output):  # a rerun's, never a mix with an earlier run's
        earlier.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        path,
        "-p",
        PLUGIN,
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-v",
        "-rA",
    ]
    started = time.monotonic()
    code, killed = ctx.launcher(
        command, _environment(ctx.worktree, log), ctx.worktree, output, limit[0], ctx.stop
    )
    ended = test_log.Ended(
        code,
        limit[1] if killed else None,
        ctx.stop.signum is not None,
        time.monotonic() - started,
        limit[0],
    )
    outputs = {
        str(item.relative_to(ctx.out)): _sha256(item)
        for item in (junit, log, output)
        if item.is_file()
    }
    text = output.read_text(errors="replace") if output.is_file() else ""
    return test_log.file_run(path, test_log.read_events(log), ended, text, ctx.worktree, outputs)


def _file_line(run: FileRun) -> str:
    """A file's end, as the console prints it while the review goes."""
    counts: dict[str, int] = {}
    for test in run.tests:
        counts[test.outcome] = counts.get(test.outcome, 0) + 1
    text = ", ".join(f"{number} {outcome}" for outcome, number in counts.items()) or "no test"
    failing = [
        f"{test.outcome} {test.test}" for test in run.tests if test.outcome in results.FAILING
    ]
    if run.ended != results.FINISHED:
        text += f"; {run.ended}: {run.detail}"
    return text + (f" ({'; '.join(failing)})" if failing else "") + f" ({run.wall_s:.0f} s)"


def _checked_out(ctx: Context, sha: str, overlay: tuple[str, ...] | None) -> str:
    """The worktree at `sha` (with the files ``overlay[1:]`` of the commit ``overlay[0]`` over
    it); the commit read back from the worktree."""
    checkout.check_out(ctx.repository, ctx.worktree, sha)
    if overlay:
        git(ctx.worktree, "checkout", overlay[0], "--", *overlay[1:])
    return git(ctx.worktree, "rev-parse", "HEAD")


def _stored_path(ctx: Context, side: str) -> pathlib.Path:
    return ctx.out / OUTPUT_DIR / f"{side}.json"


def _stored(ctx: Context, side: str, key: dict[str, Any]) -> SideTests | None:
    """The side's finished result of the same request ([Note: the PR's own tests])."""
    path = _stored_path(ctx, side)
    if not path.is_file():
        return None
    try:
        data = jsonio.read_json_file(path, what="own tests")
        stored = results.side_from_data(data["result"]) if data.get("key") == key else None
    except (jsonio.JsonInputError, KeyError, TypeError):
        return None
    if stored is None or any(
        run.ended in RERUN_ENDS or any(test.outcome in results.UNDECIDED for test in run.tests)
        for run in stored.files
    ):
        return None
    return stored._replace(kind="resumed")


def _side(
    ctx: Context, side: str, sha: str, paths: tuple[str, ...], files: TestFiles, head: str
) -> SideTests:
    """The test files `paths` (the head's) at `side`, or its stored result."""
    key = {
        "sha": sha,
        "tests_from": head,
        "files": list(paths),
        "changed": list(files.changed),
        "file_limit_s": ctx.file_limit_s,
    }
    stored = _stored(ctx, side, key)
    if stored is not None:
        ctx.say(f"own tests at the {side} {sha[:12]}: resumed ({len(stored.files)} files)")
        return stored
    overlay = None if side == "head" else (head, *files.changed)
    checked_out = _checked_out(ctx, sha, overlay)
    directory = ctx.out / OUTPUT_DIR / side
    directory.mkdir(parents=True, exist_ok=True)
    runs = []
    for index, path in enumerate(paths, start=1):
        run = _run_file(ctx, directory, index, path)
        ctx.say(f"own tests at the {side} {sha[:12]}: {path}: {_file_line(run)}")
        runs.append(run)
    result = SideTests(side, checked_out, head, tuple(runs))
    stored_data = {"key": key, "result": results.side_data(result)}
    atomic_write_text(_stored_path(ctx, side), json.dumps(stored_data, indent=2) + "\n")
    return result


def review_tests(
    step: Plan,
    wanted: dict[str, Any],
    out: pathlib.Path,
    stop: Stop,
    say: Callable[[str], None],
    launcher: Launcher = subprocess_launcher,
) -> OwnTests:
    """[Note: the PR's own tests] for the request `wanted` (its repository, SHAs, worktree)."""
    files = step.files
    if files is None:
        return results.not_run("skipped by --no-pr-tests")
    if not files.tests:
        others = f" (other files there: {', '.join(files.others)})" if files.others else ""
        reason = f"the PR adds or changes no test file under tests/{others}"
        say(f"the PR's own tests: {reason}")
        return OwnTests(results.NO_TESTS, reason, files.how, (), files.others)
    say(f"the PR's own tests ({files.how}): {', '.join(files.tests)}")
    repository, base, head = pathlib.Path(wanted["repository"]), wanted["base"], wanted["head"]
    limits = {"file_s": step.file_limit_s, "total_s": step.total_limit_s}
    ctx = Context(
        repository,
        pathlib.Path(wanted["worktree"]),
        out.absolute(),  # pytest runs in the worktree: its output paths must not be relative
        stop,
        say,
        launcher,
        step.file_limit_s,
        step.total_limit_s,
        time.monotonic() + step.total_limit_s,
    )
    try:
        at_head = _side(ctx, "head", head, files.tests, files, head)
        at_base_paths = tuple(p for p in files.tests if test_files.exists_at(repository, base, p))
        at_base = _side(ctx, "base", base, at_base_paths, files, head) if at_base_paths else None
    except GitError as error:  # the worktree could not be made: nothing observed
        return OwnTests(
            HARNESS_ERROR, f"git: {error}", files.how, files.tests, files.others, limits=limits
        )
    own = OwnTests("ran", "", files.how, files.tests, files.others, at_head, at_base, limits)
    say(results.summary_line(own).replace("**", "").replace("`", ""))
    return own
