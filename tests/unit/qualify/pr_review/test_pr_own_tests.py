"""The PR's own tests in ``qwz-qualify review`` ([Note: the PR's own tests] in
qwz/qualify/pr_review/own_tests.py; [Note: own tests in the claims table] in
qwz/qualify/review/own_tests_section.py).

The qualification runs through test_pr_review.py's fake ``run``; the own tests run for real,
with pytest and the plugin, on a repository built in the test (tests/pr_tests_repository.py:
DeepSpeed's layout, a ``DistributedTest`` that spawns its ranks). How a file's end reads when
pytest cannot tell it (a limit, a signal, pytest's own error, a module the runner lacks) is
checked on the plugin's events written here, without a process.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import pytest
import torch

from qwz.qualify.pr_review import own_tests, review_command, test_log
from qwz.qualify.review import own_tests_section as results
from qwz.qualify.review import pr_review
from qwz.qualify.review.own_tests_section import COLLECT_CLAIM, PASS_CLAIM
from tests.deepspeed_checkout import git
from tests.pr_tests_repository import BROKEN_TEST, make_repository
from tests.unit.qualify.pr_review.test_pr_review import PARSER, RUN_OPTIONS, FakeRun

ON_GPUS = "passed" if torch.cuda.device_count() >= 2 else "skipped"
"""The two-GPU test's outcome here: run where there are GPUs for it, else not run."""


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> tuple[pathlib.Path, dict[str, str]]:
    return make_repository(tmp_path_factory.mktemp("own-tests"))


class CountingLauncher:
    """The real pytest launcher, counted."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, command_line, env, cwd, output, limit_s, stop):
        self.commands.append(command_line)
        return own_tests.subprocess_launcher(command_line, env, cwd, output, limit_s, stop)


class ScriptedLauncher:
    """Stands in for pytest: writes `events` to the plugin's log and exits `code`."""

    def __init__(self, events: list[dict], code: int) -> None:
        self.events, self.code = events, code
        self.commands: list[list[str]] = []

    def __call__(self, command_line, env, cwd, output, limit_s, stop):
        self.commands.append(command_line)
        lines = "".join(json.dumps(event) + "\n" for event in self.events)
        pathlib.Path(env[own_tests.LOG_ENV]).write_text(lines)
        output.write_text("")
        return self.code, False


def review(tmp_path, repository, head: str, *extra: str, launcher=None, out="review"):
    root = repository[0]
    argv = ["review", "--repo", str(root), "--base", "main", "--head", head]
    args = PARSER.parse_args([*argv, "--out", str(tmp_path / out), *RUN_OPTIONS, *extra])
    test_launcher = launcher or own_tests.subprocess_launcher
    return review_command.run_review(args, PARSER, launcher=FakeRun(), test_launcher=test_launcher)


def summary(tmp_path, out="review") -> dict:
    return json.loads((tmp_path / out / pr_review.JSON).read_text())


def rows(data: dict) -> dict[str, dict]:
    return {row["claim"]: row for row in data["claims"]}


def outcomes(side: dict) -> dict[str, str]:
    return {test["test"]: test["outcome"] for run in side["files"] for test in run["tests"]}


def test_a_head_whose_own_tests_pass_passes_listing_each_test(tmp_path, repository, capsys):
    root, shas = repository
    launcher = CountingLauncher()
    assert review(tmp_path, repository, "passing", launcher=launcher) == 0
    data = summary(tmp_path)
    own, table = data["own_tests"], rows(data)
    assert own["head"]["sha"] == shas["passing"] and own["verdict"] == "PASS"
    assert outcomes(own["head"]) == {
        "tests/unit/test_existing.py::test_version_exists": "passed",
        "tests/unit/test_existing.py::test_version_is_head": "passed",
        "tests/unit/test_head_version.py::test_the_heads_deepspeed_is_imported": "passed",
        "tests/unit/test_head_version.py::TestAllReduce::test_sums_over_ranks": "passed",
        "tests/unit/test_needs_gpu.py::TestOnTwoGpus::test_sees_a_gpu": ON_GPUS,
    }
    passed = table[PASS_CLAIM]
    assert passed["verdict"] == "PASS" and set(passed["checks"]) == set(outcomes(own["head"]))
    if ON_GPUS == "skipped":  # a CPU runner: listed as not run, with DeepSpeed's reason
        assert "4 passed, 0 failed, 0 errors, 1 skipped (not run)" in passed["detail"]
        assert (
            "not run, skipped: only supported in accelerator environments.: "
            "tests/unit/test_needs_gpu.py::TestOnTwoGpus::test_sees_a_gpu" in passed["detail"]
        )
    assert table[COLLECT_CLAIM]["verdict"] == "PASS"
    # At the base, the head's changed file on the base's code: one test passes there too.
    assert outcomes(own["base"]) == {
        "tests/unit/test_existing.py::test_version_exists": "passed",
        "tests/unit/test_existing.py::test_version_is_head": "failed",
    }
    assert (
        "1 pass on the base's code too, proving nothing new about the change: "
        "tests/unit/test_existing.py::test_version_exists" in passed["detail"]
    )
    assert "1 fail there, so they test the change" in passed["detail"]
    # Bound to the head: the commit read back from the worktree, pytest's XML hashed.
    head_files = own["head"]["files"]
    junit = [name for run in head_files for name in run["outputs"] if name.endswith(".xml")]
    assert len(junit) == 3 and all((tmp_path / "review" / name).is_file() for name in junit)
    # Never in the user's checkout, which stays on the base and clean.
    assert git(root, "rev-parse", "HEAD").strip() == shas["main"]
    assert git(root, "status", "--porcelain") == ""
    assert all(cmd[cmd.index("pytest") + 1].startswith("tests/") for cmd in launcher.commands)
    said = capsys.readouterr()
    assert (
        "own tests at the head" in said.err and "tests/unit/test_existing.py: 2 passed" in said.err
    )
    first_page = (tmp_path / "review" / pr_review.MARKDOWN).read_text().split("| claim |")[0]
    assert "**PASS** (exit 0)" in first_page
    assert f"The PR's own tests at its head `{shas['passing'][:12]}`: **PASS**, " in first_page

    again = CountingLauncher()
    assert review(tmp_path, repository, "passing", launcher=again) == 0
    assert again.commands == []  # [Note: review resume]: each side's result reused
    assert [summary(tmp_path)["own_tests"][side]["kind"] for side in ("head", "base")] == [
        "resumed",
        "resumed",
    ]


def test_the_same_head_with_an_own_test_broken_fails_naming_it(tmp_path, repository, capsys):
    assert review(tmp_path, repository, "broken") == 1
    data = summary(tmp_path)
    assert data["status"] == "FAIL" and [run["status"] for run in data["runs"]] == ["PASS"] * 2
    passed, collected = rows(data)[PASS_CLAIM], rows(data)[COLLECT_CLAIM]
    assert passed["verdict"] == "FAIL"
    assert f"failed {BROKEN_TEST} (AssertionError: assert 'head' == 'HEAD')" in passed["detail"]
    assert collected["verdict"] == "FAIL"
    assert (
        "tests/unit/test_does_not_import.py (does not collect: ModuleNotFoundError: No module "
        "named 'deepspeed.runtime')" in collected["detail"]
    )
    assert f"failed {BROKEN_TEST}" in capsys.readouterr().err


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie waiting for its reaper has)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in ("Z", "X")


def test_a_hang_is_named_as_a_hang_and_its_processes_end_with_it(tmp_path, repository, monkeypatch):
    """``--pr-tests`` names the one file; it runs past its own limit, which is the PR's FAIL
    naming the test that was running; the process it started is killed with it."""
    monkeypatch.setenv("QWZ_TEST_CHILD_PID_FILE", str(tmp_path / "child.pid"))
    extra = ["--pr-tests", "tests/unit/test_hangs.py", "--pr-tests-file-timeout", "10"]
    started = time.monotonic()
    assert review(tmp_path, repository, "hangs", *extra) == 1
    assert time.monotonic() - started < 60
    passed = rows(summary(tmp_path))[PASS_CLAIM]
    assert passed["verdict"] == "FAIL"
    assert (
        "hang tests/unit/test_hangs.py::test_waits_for_a_reply_that_never_comes (running when "
        "the file hit its limit: no end within the file's limit of 10 s" in passed["detail"]
    )
    assert summary(tmp_path)["own_tests"]["how"] == "--pr-tests"
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


def test_a_relative_out_keeps_pytests_outputs(tmp_path, repository, monkeypatch):
    """pytest runs in the worktree: outputs named relative to the review's directory would
    land nowhere (a harness error, never the PR's)."""
    monkeypatch.chdir(tmp_path)
    root = repository[0]
    argv = ["review", "--repo", str(root), "--base", "main", "--head", "passing", "--out",
            "relative", *RUN_OPTIONS, "--pr-tests", "tests/unit/test_existing.py"]  # fmt: skip
    assert review_command.run_review(PARSER.parse_args(argv), PARSER, launcher=FakeRun()) == 0
    head = summary(tmp_path, "relative")["own_tests"]["head"]
    assert outcomes(head) == dict.fromkeys(
        ["tests/unit/test_existing.py::test_version_exists",
         "tests/unit/test_existing.py::test_version_is_head"], "passed"
    )  # fmt: skip


def test_pytests_own_error_is_no_verdict_and_runs_again_on_resume(tmp_path, repository):
    """An internal error of pytest is the harness's (exit 4, never the PR's FAIL), and a
    resumed review runs the files again instead of keeping it."""
    extra = ["--pr-tests", "tests/unit/test_existing.py"]
    internal = ScriptedLauncher([{"event": "internal-error", "message": "INTERNALERROR> x"}], 3)
    assert review(tmp_path, repository, "passing", *extra, launcher=internal) == 4
    assert rows(summary(tmp_path))[PASS_CLAIM]["verdict"] == "HARNESS-ERROR"
    again = CountingLauncher()
    assert review(tmp_path, repository, "passing", *extra, launcher=again) == 0
    assert len(again.commands) == 2  # the head's file and the base's, run again
    assert rows(summary(tmp_path))[PASS_CLAIM]["verdict"] == "PASS"


class SlowKilledLauncher(ScriptedLauncher):
    """Stands in for a pytest still running when its limit came: killed at it."""

    def __call__(self, command_line, env, cwd, output, limit_s, stop):
        self.limits = [*getattr(self, "limits", []), limit_s]
        super().__call__(command_line, env, cwd, output, limit_s, stop)
        time.sleep(limit_s)
        return -signal.SIGKILL, True


def test_the_total_limit_is_the_runners_never_the_prs_fail(tmp_path, repository):
    """The first file gets what is left of ``--pr-tests-timeout`` (less than its own limit)
    and is cut there; the next is not run; INCONCLUSIVE (exit 3), the limit named."""
    running = [{"event": "collected", "nodeids": []}]
    launcher = SlowKilledLauncher(running, 0)
    extra = ["--pr-tests-timeout", "1", "--pr-tests-file-timeout", "100"]
    assert review(tmp_path, repository, "broken", *extra, launcher=launcher) == 3
    assert len(launcher.limits) == 1 and launcher.limits[0] <= 1
    files = summary(tmp_path)["own_tests"]["head"]["files"]
    assert [run["ended"] for run in files] == [results.OVER_TOTAL, results.FILE_NOT_RUN]
    assert "(--pr-tests-timeout) was spent before it started" in files[1]["detail"]
    assert rows(summary(tmp_path))[PASS_CLAIM]["verdict"] == "INCONCLUSIVE"


def test_no_pr_tests_skips_the_step_and_says_so(tmp_path, repository):
    launcher = CountingLauncher()
    assert review(tmp_path, repository, "broken", "--no-pr-tests", launcher=launcher) == 0
    assert launcher.commands == []
    table = rows(summary(tmp_path))
    assert [table[claim]["verdict"] for claim in (COLLECT_CLAIM, PASS_CLAIM)] == ["not run"] * 2
    assert table[PASS_CLAIM]["detail"] == "skipped by --no-pr-tests"


def test_a_pr_that_changes_no_test_says_so(tmp_path):
    root, shas = make_repository(tmp_path)
    git(root, "checkout", "-q", "-b", "no-tests", "main")
    (root / "deepspeed" / "__init__.py").write_text("version = 'head'\n")
    git(root, "commit", "-q", "-am", "no test changed")
    launcher = CountingLauncher()
    repository = (root, {**shas, "no-tests": git(root, "rev-parse", "HEAD").strip()})
    assert review(tmp_path, repository, "no-tests", launcher=launcher) == 0
    assert launcher.commands == []
    markdown = (tmp_path / "review" / pr_review.MARKDOWN).read_text()
    assert "The PR's own tests: no tests (the PR adds or changes no test file under tests/)." in (
        markdown
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pr-tests", "tests/unit/nope.py"], "--pr-tests tests/unit/nope.py is not a file of"),
        (["--pr-tests-timeout", "0"], "--pr-tests-timeout: 0 is invalid"),
    ],
)
def test_a_bad_own_tests_request_is_refused_before_anything_runs(
    tmp_path, repository, capsys, extra, message
):
    if extra[0] == "--pr-tests-timeout":
        with pytest.raises(SystemExit):
            review(tmp_path, repository, "passing", *extra)
    else:
        assert review(tmp_path, repository, "passing", *extra) == 2
        assert not (tmp_path / "review").exists()
    assert message in capsys.readouterr().err


def test_no_pytest_is_refused_before_anything_runs(tmp_path, repository, monkeypatch, capsys):
    """pytest missing is this runner's, never the PR's: refused, with the way out."""
    monkeypatch.setattr(own_tests, "pytest_available", lambda: False)
    assert review(tmp_path, repository, "passing") == 2
    said = capsys.readouterr().err
    assert "pytest is not installed for" in said and "--no-pr-tests" in said
    assert review(tmp_path, repository, "passing", "--no-pr-tests", out="without") == 0


# ------------------------------------------------- a file's end, from the plugin's events
FILE = "tests/unit/test_x.py"
WORKTREE = pathlib.Path("/checkout")


def _start(name: str) -> dict:
    return {"event": "start", "nodeid": f"{FILE}::{name}"}


def _phases(name: str, outcome: str = "passed", message: str = "", **call) -> list[dict]:
    base = {"event": "report", "nodeid": f"{FILE}::{name}", "message": "", "seconds": 0.1}
    return [
        {**base, "when": "setup", "outcome": "passed"},
        {**base, "when": "call", "outcome": outcome, "message": message, **call},
        {**base, "when": "teardown", "outcome": "passed"},
    ]


COLLECTED = [
    {"event": "rootdir", "path": str(WORKTREE)},
    {"event": "collected", "nodeids": [f"{FILE}::test_a", f"{FILE}::test_b", f"{FILE}::test_c"]},
]
A_PASSES_B_RUNS = [*COLLECTED, _start("test_a"), *_phases("test_a"), _start("test_b")]


def _file(events, code=0, at_limit=None, stopped=False, output="", worktree=WORKTREE):
    ended = test_log.Ended(code, at_limit, stopped, 3.0, 30.0)
    return test_log.file_run(FILE, events, ended, output, worktree, {})


def _verdict(run: results.FileRun) -> str:
    side = results.SideTests("head", "0" * 40, "0" * 40, (run,))
    return results.verdict(results.OwnTests("ran", "", "diff", (FILE,), (), side))


def _by_test(run: results.FileRun) -> dict[str, str]:
    return {test.test.split("::")[1]: test.outcome for test in run.tests}


@pytest.mark.parametrize(
    ("end", "outcome", "verdict"),
    [
        ({"at_limit": "file"}, results.HANG, "FAIL"),
        ({"at_limit": "total"}, results.OVER_TOTAL, "INCONCLUSIVE"),
        ({"code": -signal.SIGSEGV}, results.CRASHED, "FAIL"),
        ({"stopped": True, "code": -signal.SIGTERM}, results.INTERRUPTED, "INCONCLUSIVE"),
    ],
)
def test_the_test_running_when_its_file_ended_is_named_by_how_it_ended(end, outcome, verdict):
    """A hang or a crash is the PR's; the step's total limit or the review's own signal is
    not, and never its FAIL."""
    run = _file(A_PASSES_B_RUNS, **end)
    assert _by_test(run) == {"test_a": "passed", "test_b": outcome, "test_c": "not reached"}
    assert run.ended == outcome and _verdict(run) == verdict


def test_a_test_that_stops_pytest_is_named_with_its_message():
    """DeepSpeed's DistributedTest calls ``pytest.exit("Test hanged, exiting")`` past its own
    timeout: the PR's FAIL, naming the test and the message."""
    events = [*A_PASSES_B_RUNS, {"event": "exit", "message": "Test hanged, exiting"}]
    run = _file(events, code=1)
    assert run.ended == results.STOPPED and _by_test(run)["test_b"] == results.STOPPED
    assert run.tests[1].reason.endswith("pytest.exit: Test hanged, exiting")
    assert _verdict(run) == "FAIL"


@pytest.mark.parametrize(
    ("events", "code", "output", "ended", "verdict"),
    [
        ([{"event": "internal-error", "message": "boom"}], 3, "", "harness error", "HARNESS-ERROR"),
        ([], 4, "ERROR: usage: unrecognized arguments: --x", "harness error", "HARNESS-ERROR"),
        ([], 4, "ImportError while loading conftest '/c/tests/conftest.py'.\nE  NameError: x",
         "does not collect", "FAIL"),
        ([{"event": "collect-error", "nodeid": FILE, "message": "ModuleNotFoundError: No module "
           "named 'transformers'"}], 2, "", "cannot run here", "INCONCLUSIVE"),
        ([{"event": "collect-error", "nodeid": FILE, "message": "ModuleNotFoundError: No module "
           "named 'deepspeed.nope'"}], 2, "", "does not collect", "FAIL"),
    ],
)  # fmt: skip
def test_a_file_that_never_ran_a_test_says_whose_doing_that_was(
    tmp_path, events, code, output, ended, verdict
):
    """pytest's own errors are the harness's; a conftest or import the PR broke is the PR's;
    a module this runner lacks (not the checkout's own) cannot be judged here."""
    (tmp_path / "deepspeed").mkdir()  # the checkout's own package
    run = _file(events, code=code, output=output, worktree=tmp_path)
    assert run.ended == ended and _verdict(run) == verdict and not run.collected


@pytest.mark.parametrize(
    ("module", "outcome", "verdict"),
    [("mpi4py", results.CANNOT_RUN, "INCONCLUSIVE"), ("deepspeed.nope", results.FAILED, "FAIL")],
)
def test_a_test_failing_for_a_module_this_runner_lacks_is_not_the_prs_fail(
    tmp_path, module, outcome, verdict
):
    (tmp_path / "deepspeed").mkdir()  # the checkout's own package
    message = f"ModuleNotFoundError: No module named '{module}'"
    events = [*COLLECTED[1:], _start("test_a"), *_phases("test_a"), _start("test_b")]
    events += _phases("test_b", "failed", message)
    run = _file(events, code=1, worktree=tmp_path)
    assert _by_test(run) == {"test_a": "passed", "test_b": outcome, "test_c": "not reached"}
    assert _verdict(run) == verdict


def test_tests_that_all_skip_decide_nothing():
    """Nothing vacuous passes: skipped and deselected tests are not run, never passed."""
    events = [
        *COLLECTED[:1],
        {"event": "collected", "nodeids": [f"{FILE}::test_a"]},
        {"event": "deselected", "nodeids": [f"{FILE}::test_slow"]},
        _start("test_a"),
        *_phases("test_a", "skipped", "needs an accelerator"),
    ]
    run = _file(events)
    assert _by_test(run) == {"test_a": "skipped", "test_slow": "deselected"}
    assert _verdict(run) == "INCONCLUSIVE"


def test_an_expected_failure_is_no_pass_and_a_torn_log_line_no_event(tmp_path):
    log = tmp_path / "events.jsonl"
    lines = [json.dumps(event) for event in [*COLLECTED[:1], _start("test_a")]]
    xfail = _phases("test_a", "skipped", "", xfail="known bug")
    log.write_text("\n".join([*lines, *map(json.dumps, xfail)]) + '\n{"event": "sta')
    events = test_log.read_events(log)
    assert len(events) == 5
    run = _file([*events, {"event": "collected", "nodeids": [f"{FILE}::test_a"]}])
    assert _by_test(run) == {"test_a": results.XFAILED}
    assert _verdict(run) == "INCONCLUSIVE"


def test_a_killed_file_kills_what_it_started(tmp_path):
    """``supervise.run_within``: at the limit the whole session goes, not the child alone."""
    from qwz.qualify.base.supervise import Stop, run_within

    pid_file = tmp_path / "pid"
    script = f"sleep 600 & echo $! > {pid_file}; wait"
    with (tmp_path / "out").open("w") as out:
        code, killed = run_within(["bash", "-c", script], Stop(), 2.0, stdout=out, stderr=out)
    assert killed and code == -signal.SIGKILL
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), os.popen(f"ps -o pid,stat,cmd -p {pid}").read()
