"""The GitHub workflows, tox.ini and ci/nightly.sh hold the properties a maintainer merges on.

Each workflow under .github/workflows/ is parsed (PyYAML) and checked for: least-privilege
`permissions:`, `concurrency:`, self-hosted (GPU) jobs that never run a fork's pull request
unless a maintainer set the `gpu-ok` label on that head, no `actions/cache` for the nightly's
baselines, ledger or history, a lint job and tox env that install ruff alone, CPU torch from
the CPU index with a pip cache, a job summary after every job that runs tests or a
qualification, and the nightly's signing-key guard. `if:` conditions and `${{ }}` values are
evaluated by a small evaluator of GitHub's expression language over the events that matter
(a fork's pull request opened, pushed to, labeled; a branch's pull request; a push to main),
so a guard is judged by what it does, not by how it is spelled. actionlint, where installed,
checks the syntax; these tests check the policy.
"""

from __future__ import annotations

import configparser
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Any

import pytest
import yaml  # PyYAML: the test extra

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
RUFF = "ruff==0.17.6"
REPOSITORY = "qwz-org/qwz"
GPU_LABEL = "gpu-ok"


def load(path: pathlib.Path) -> dict[str, Any]:
    workflow = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as the boolean True.
    workflow["on"] = workflow.pop(True, workflow.get("on"))
    return workflow


def triggers(workflow: dict[str, Any]) -> dict[str, Any]:
    on = workflow["on"]
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return on


def runs_on_self_hosted(job: dict[str, Any]) -> bool:
    runs_on = job.get("runs-on", [])
    labels = [runs_on] if isinstance(runs_on, str) else list(runs_on)
    return "self-hosted" in labels


def all_jobs() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path.name, name, job) for path in WORKFLOWS for name, job in load(path)["jobs"].items()
    ]


# --------------------------------------------------------------------------- #
# A small evaluator of GitHub's expression language (what the workflows use)
# --------------------------------------------------------------------------- #

_TOKEN = re.compile(
    r"\s*(?:(?P<string>'(?:[^']|'')*')|(?P<number>\d+(?:\.\d+)?)"
    r"|(?P<op>==|!=|<=|>=|&&|\|\||[!<>(),])|(?P<name>[A-Za-z_][A-Za-z0-9_.\-*]*))"
)
_FUNCTIONS = {
    "always": lambda: True,
    "success": lambda: True,
    "cancelled": lambda: False,
    "failure": lambda: False,
    "contains": lambda haystack, needle: (
        needle in haystack
        if isinstance(haystack, list)
        else str(needle).lower() in str(haystack or "").lower()
    ),
}


def _tokens(text: str) -> list[tuple[str, Any]]:
    out, position = [], 0
    while position < len(text.rstrip()):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"cannot read the expression {text!r} at {text[position:]!r}")
        kind = match.lastgroup
        value = match.group(kind)
        if kind == "string":
            value = value[1:-1].replace("''", "'")
        out.append((kind, value))
        position = match.end()
    return out


def _lookup(context: dict[str, Any], dotted: str) -> Any:
    literals = {"true": True, "false": False, "null": None}
    if dotted in literals:
        return literals[dotted]
    values: list[Any] = [context]
    star = False
    for part in dotted.split("."):
        if part == "*":  # `labels.*.name`: the names of every label
            values = [item for value in values if isinstance(value, list) for item in value]
            star = True
            continue
        values = [value.get(part) if isinstance(value, dict) else None for value in values]
    return values if star else values[0]


def _equal(left: Any, right: Any) -> bool:
    if isinstance(left, str) and isinstance(right, str):
        return left.lower() == right.lower()  # GitHub compares strings case-insensitively
    return left == right


def evaluate(expression: str, context: dict[str, Any]) -> Any:
    """Value of a GitHub expression (with or without `${{ }}`) in `context`."""
    text = expression.strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    tokens = _tokens(text)
    position = 0

    def peek() -> Any:
        return tokens[position][1] if position < len(tokens) else None

    def take() -> tuple[str, Any]:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def primary() -> Any:
        kind, value = take()
        if value == "!" and kind == "op":
            return not primary()
        if value == "(" and kind == "op":
            inner = disjunction()
            assert take()[1] == ")", f"unbalanced parentheses in {expression!r}"
            return inner
        if kind in ("string", "number"):
            return value if kind == "string" else float(value)
        if peek() == "(":
            take()
            arguments = []
            while peek() != ")":
                arguments.append(disjunction())
                if peek() == ",":
                    take()
            take()
            return _FUNCTIONS[value](*arguments)
        return _lookup(context, value)

    def comparison() -> Any:
        left = primary()
        while peek() in ("==", "!="):
            operator = take()[1]
            right = primary()
            left = _equal(left, right) if operator == "==" else not _equal(left, right)
        return left

    def conjunction() -> Any:
        left = comparison()
        while peek() == "&&":
            take()
            right = comparison()
            left = right if left else left
        return left

    def disjunction() -> Any:
        left = conjunction()
        while peek() == "||":
            take()
            right = conjunction()
            left = left if left else right
        return left

    value = disjunction()
    assert position == len(tokens), f"trailing tokens in {expression!r}"
    return value


def event(
    name: str, *, action: str | None = None, fork: bool = False, label: str | None = None
) -> dict[str, Any]:
    """The context of one event: a pull request (from a fork or a branch) or a push."""
    context: dict[str, Any] = {
        "github": {"event_name": name, "repository": REPOSITORY, "ref": "refs/heads/main"},
        "inputs": {},
        "vars": {},
        "secrets": {},
    }
    context["github"]["sha"] = "merge0000"
    if name == "pull_request":
        head_repo = "someone/qwz" if fork else REPOSITORY
        context["github"]["ref"] = "refs/pull/7/merge"
        context["github"]["event"] = {
            "action": action,
            "label": {"name": label} if label else None,
            "pull_request": {
                "number": 7,
                "head": {"sha": "head1111", "repo": {"full_name": head_repo}},
                # A fork's pull request carries the label from an earlier review: a push
                # after it (`synchronize`) or another label must still not run it.
                "labels": [{"name": GPU_LABEL}] if fork else [],
            },
        }
    return context


# --------------------------------------------------------------------------- #
# The properties
# --------------------------------------------------------------------------- #


def test_workflows_exist():
    names = {path.name for path in WORKFLOWS}
    assert {"ci.yml", "multigpu.yml", "nightly.yml"} <= names, names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda path: path.name)
def test_permissions_are_least_privilege(path):
    workflow = load(path)
    top = workflow.get("permissions")
    assert isinstance(top, dict), f"{path.name}: no top-level `permissions:` map"
    assert top == {"contents": "read"}, f"{path.name}: top-level permissions {top}"
    for name, job in workflow["jobs"].items():
        granted = job.get("permissions", {})
        writes = {scope for scope, level in granted.items() if level == "write"}
        if not writes:
            continue
        steps = job.get("steps", [])
        # A job that may write runs no project code: no checkout, GitHub-hosted.
        assert not runs_on_self_hosted(job), f"{path.name}:{name} writes on a self-hosted runner"
        assert not any("actions/checkout" in step.get("uses", "") for step in steps), (
            f"{path.name}:{name} may write ({writes}) and checks out the code"
        )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda path: path.name)
def test_concurrency_groups(path):
    workflow = load(path)
    if "concurrency" in workflow:
        assert workflow["concurrency"].get("group"), f"{path.name}: concurrency without a group"
        return
    for name, job in workflow["jobs"].items():
        assert job.get("concurrency", {}).get("group"), f"{path.name}:{name} has no concurrency"


def _runs(job: dict[str, Any], context: dict[str, Any]) -> bool:
    condition = job.get("if")
    return True if condition is None else bool(evaluate(str(condition), context))


SELF_HOSTED = [(wf, name, job) for wf, name, job in all_jobs() if runs_on_self_hosted(job)]


@pytest.mark.parametrize(
    "workflow,name,job", SELF_HOSTED, ids=[f"{wf}:{name}" for wf, name, _ in SELF_HOSTED]
)
def test_self_hosted_jobs_never_run_unvetted_fork_code(workflow, name, job):
    on = triggers(load(ROOT / ".github" / "workflows" / workflow))
    assert "pull_request_target" not in on, f"{workflow}: pull_request_target on a GPU runner"
    if "pull_request" not in on:
        return
    where = f"{workflow}:{name}"
    for action in ("opened", "synchronize", "reopened"):
        assert not _runs(job, event("pull_request", action=action, fork=True)), (
            f"{where} runs a fork's pull request on `{action}` (label or not)"
        )
    assert not _runs(job, event("pull_request", action="labeled", fork=True, label="docs")), (
        f"{where} runs a fork's pull request when some other label is set"
    )
    assert _runs(job, event("pull_request", action="labeled", fork=True, label=GPU_LABEL)), (
        f"{where}: a maintainer's `{GPU_LABEL}` label does not start the job"
    )
    assert _runs(job, event("pull_request", action="synchronize")), (
        f"{where} does not run a same-repository pull request"
    )
    assert _runs(job, event("push")), f"{where} does not run on a push to main"
    # What runs is the head the maintainer read, not whatever the ref points at later.
    checkout = next(s for s in job["steps"] if "actions/checkout" in s.get("uses", ""))
    ref = checkout.get("with", {}).get("ref")
    labeled = event("pull_request", action="labeled", fork=True, label=GPU_LABEL)
    assert ref is not None and evaluate(ref, labeled) == "head1111", f"{where}: checkout {ref}"
    assert checkout["with"].get("persist-credentials") is False, f"{where} keeps the token"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda path: path.name)
def test_no_state_in_actions_cache(path):
    for name, job in load(path)["jobs"].items():
        for step in job.get("steps", []):
            if not step.get("uses", "").startswith("actions/cache"):
                continue
            cached = str(step.get("with", {}).get("path", ""))
            assert not re.search(r"baseline|ledger|history|nightly", cached), (
                f"{path.name}:{name} keeps {cached!r} in actions/cache, which is evicted"
            )


def test_nightly_baselines_are_in_the_repository():
    nightly = load(ROOT / ".github" / "workflows" / "nightly.yml")
    steps = nightly["jobs"]["requalify"]["steps"]
    env = next(s["env"] for s in steps if "ci/nightly.sh" in s.get("run", ""))
    baseline_dir = env["QWZ_BASELINE_DIR"]
    assert baseline_dir.startswith("ci/baselines/"), baseline_dir
    assert (ROOT / "ci" / "baselines" / "README.md").is_file()
    assert 'baseline_root="${QWZ_BASELINE_DIR:-' in (ROOT / "ci" / "nightly.sh").read_text()


def _pip_installs(run: str) -> list[list[str]]:
    """The package arguments of every `pip install` in a run script."""
    installs = []
    for line in run.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for index in range(len(words) - 1):
            if words[index] == "pip" and words[index + 1] == "install":
                installs.append([w for w in words[index + 2 :] if not w.startswith("-")])
    return installs


def test_lint_installs_only_ruff():
    ci = load(ROOT / ".github" / "workflows" / "ci.yml")
    runs = [step.get("run", "") for step in ci["jobs"]["lint"]["steps"]]
    installs = [packages for run in runs for packages in _pip_installs(run)]
    assert installs == [[RUFF]], f"the lint job installs {installs}"
    assert not any(re.search(r"ci/|tox|requirements|-e ", run) for run in runs), runs
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert tox["testenv:lint"]["skip_install"].strip() == "true"
    assert tox["testenv:lint"]["deps"].split() == [RUFF]


def test_cpu_jobs_take_torch_from_the_cpu_index_with_a_pip_cache():
    ci = load(ROOT / ".github" / "workflows" / "ci.yml")
    for name, job in ci["jobs"].items():
        steps = job["steps"]
        if not any(
            re.search(r"bash ci/(unit|test|qualify-cpu)\.sh", s.get("run", "")) for s in steps
        ):
            continue
        env = {**ci.get("env", {}), **job.get("env", {})}
        assert env.get("QWZ_TORCH_INDEX_URL") == CPU_TORCH_INDEX, f"ci.yml:{name}: {env}"
        setup = [s for s in steps if s.get("uses", "").startswith("actions/setup-python")]
        assert setup and setup[0].get("with", {}).get("cache") == "pip", f"ci.yml:{name}"
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    deps = tox["testenv"]["deps"].split()
    assert deps == [f"--index-url={{env:QWZ_TORCH_INDEX_URL:{CPU_TORCH_INDEX}}}", "torch==2.13.0"]
    assert "PIP_*" in tox["testenv"]["pass_env"].split(), "tox does not pass pip's settings"


def test_every_test_or_qualification_job_writes_a_job_summary():
    for workflow, name, job in all_jobs():
        steps = job.get("steps", [])
        works = [
            i
            for i, s in enumerate(steps)
            if re.search(r"bash ci/(?!job-summary)", s.get("run", ""))
        ]
        if not works:
            continue
        summaries = [i for i, s in enumerate(steps) if "ci/job-summary.sh" in s.get("run", "")]
        assert summaries and summaries[-1] > works[-1], f"{workflow}:{name}: no summary after"
        assert "always()" in str(steps[summaries[-1]].get("if")), f"{workflow}:{name}"


def test_job_summary_script(tmp_path):
    report = tmp_path / "report.md"
    report.write_text("# qwz qualification: PASS\n")
    summary = tmp_path / "summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    args = ["bash", str(ROOT / "ci" / "job-summary.sh"), "main job", str(report), "gone.md"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = summary.read_text()
    assert text.startswith("## main job")
    assert "# qwz qualification: PASS" in text
    assert "`gone.md`: missing" in text


def test_nightly_needs_the_signing_key_unless_allowed():
    nightly = load(ROOT / ".github" / "workflows" / "nightly.yml")
    steps = nightly["jobs"]["requalify"]["steps"]
    env = next(s["env"] for s in steps if "ci/nightly.sh" in s.get("run", ""))
    assert env["QWZ_RECORD_KEY"].replace(" ", "") == "${{secrets.QWZ_RECORD_KEY}}"
    allow = env["QWZ_ALLOW_UNSIGNED"]
    schedule = event("schedule")
    assert evaluate(allow, schedule) == "0", "the scheduled night is allowed to run unsigned"
    dispatched = event("workflow_dispatch")
    dispatched["inputs"] = {"allow_unsigned": True}
    assert evaluate(allow, dispatched) == "1", "the allow_unsigned input has no effect"
    variable = event("schedule")
    variable["vars"] = {"QWZ_ALLOW_UNSIGNED": "1"}
    assert evaluate(allow, variable) == "1", "the QWZ_ALLOW_UNSIGNED variable has no effect"
    inputs = nightly["on"]["workflow_dispatch"]["inputs"]
    assert inputs["allow_unsigned"]["default"] is False


def _nightly(tmp_path: pathlib.Path, **extra: str) -> subprocess.CompletedProcess[str]:
    # If the guard lets the night through, ci/env.sh must fail at once (PYTHON=false, no
    # venv), never install anything.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("QWZ_RECORD_KEY", "QWZ_RECORD_KEY_FILE", "QWZ_ALLOW_UNSIGNED")
    }
    env.update(PYTHON="false", QWZ_VENV=str(tmp_path / "no-venv"), **extra)
    args = ["bash", str(ROOT / "ci" / "nightly.sh")]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)


def test_nightly_script_refuses_to_run_unsigned(tmp_path):
    refused = _nightly(tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "no signing key" in refused.stderr
    assert "creating" not in refused.stderr, "the guard ran after ci/env.sh"
    allowed = _nightly(tmp_path, QWZ_ALLOW_UNSIGNED="1")
    assert "ci/env.sh: creating" in allowed.stderr, allowed.stderr
    keyed = _nightly(tmp_path, QWZ_RECORD_KEY="0123456789abcdef0123456789abcdef")
    assert "ci/env.sh: creating" in keyed.stderr, keyed.stderr
    assert not (tmp_path / "no-venv").exists()


def test_the_nightly_runs_a_matrix_spec_that_loads_and_gates_it_cell_by_cell():
    """The workflow names a spec for the scheduled night and for a DeepSpeed ref, each
    exists and loads (qwz/qualify/matrix/matrix_spec.py) with the subject its mode qualifies, and
    ci/nightly.sh runs the matrix and compares the matrix directories, not a stage loop."""
    from qwz.qualify.matrix.matrix_spec import load as load_spec

    nightly = load(ROOT / ".github" / "workflows" / "nightly.yml")
    steps = nightly["jobs"]["requalify"]["steps"]
    env = next(s["env"] for s in steps if "ci/nightly.sh" in s.get("run", ""))
    scheduled = evaluate(env["QWZ_NIGHTLY_SPEC"], event("schedule"))
    dispatched = event("workflow_dispatch")
    dispatched["inputs"] = {"deepspeed_ref": "pull/1/head"}
    native = evaluate(env["QWZ_NIGHTLY_SPEC"], dispatched)
    script = (ROOT / "ci" / "nightly.sh").read_text()
    defaults = re.search(r"default_spec=(\S+); else default_spec=(\S+); fi", script)
    assert defaults, "ci/nightly.sh has no default spec for each mode"
    for path, subject in (
        (scheduled, "qwz"),
        (native, "deepspeed-native"),
        (defaults.group(2), "qwz"),
        (defaults.group(1), "deepspeed-native"),
    ):
        spec = load_spec(ROOT / path)
        assert {cell.value("subject") for cell in spec.cells} == {subject}, path
        assert {cell.value("stage") for cell in spec.cells} == {1, 2}, path
        assert {cell.value("group_sizes") for cell in spec.cells} == {(64, 8192)}, path
    assert 'qwz-qualify matrix "$spec" --out "$out"' in script
    assert 'qwz-qualify compare "${gate[@]}" "$baseline_dir" "$out"' in script
    assert "for stage in" not in script


def _pytest_selection(command: str) -> tuple[list[str], str | None]:
    """The test paths and the ``-m`` expression of one pytest command line."""
    words = shlex.split(command.partition("||")[0])
    words = words[words.index("pytest") + 1 :]
    paths, marker, index = [], None, 0
    while index < len(words):
        word = words[index]
        if word == "-m":
            marker, index = words[index + 1], index + 2
            continue
        if word in ("-n", "--dist", "--hypothesis-profile"):
            index += 2
            continue
        if not word.startswith(("-", "{", "$")):
            paths.append(word)
        index += 1
    return paths, marker


def test_ci_runs_every_test_tox_runs_with_every_extra_installed():
    """tox's unit and multigpu environments install fewer extras (a test needing one skips,
    naming it); `.ci/run` is the README's test command, which runs every test of both
    selections with the test, deepspeed and qualify extras installed, so nothing tox skips
    goes unrun in CI."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    command = (ROOT / "ci" / "test.sh").read_text()
    ci_line = next(line for line in command.splitlines() if "-m pytest" in line)
    ci_paths, ci_marker = _pytest_selection(ci_line.replace("python -m pytest", "pytest"))
    assert ci_paths == ["tests"] and ci_marker is None, ci_line  # everything, unfiltered
    for env in ("unit", "multigpu"):
        paths, marker = _pytest_selection(tox[f"testenv:{env}"]["commands"].strip())
        assert paths and all(path.startswith("tests/") for path in paths), (env, paths)
        assert marker in ("multigpu", "not multigpu"), (env, marker)
    env_sh = (ROOT / "ci" / "env.sh").read_text()
    assert "[test,deepspeed,qualify" in env_sh, "ci/env.sh installs every extra the tests use"
    assert "bash ci/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_nightly_runs_the_tests_the_test_command_leaves_to_it():
    """A test marked ``nightly`` is deselected by every pytest run (tests/conftest.py, unless
    ``QWZ_NIGHTLY_TESTS=1``) and run by ci/nightly.sh: its multigpu line selects ``-m nightly``
    over tests/multigpu, its unit line every test of tests/unit not marked multigpu, both with
    ``QWZ_NIGHTLY_TESTS=1``. A test marked ``nightly`` outside those two selections would be
    run by no one."""
    script = (ROOT / "ci" / "nightly.sh").read_text()
    lines = [line.strip() for line in script.splitlines() if "python -m pytest" in line]
    selections = {}
    for line in lines:
        assert line.startswith("QWZ_NIGHTLY_TESTS=1 "), line
        paths, marker = _pytest_selection(line.replace("python -m pytest", "pytest"))
        selections[tuple(paths)] = marker
    assert selections == {("tests/unit",): "not multigpu", ("tests/multigpu",): "nightly"}
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert 'os.environ.get("QWZ_NIGHTLY_TESTS") == "1"' in conftest
    assert "pytest_deselected(items=nightly)" in conftest
    here = pathlib.Path(__file__).resolve()
    elsewhere = []
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        if path.resolve() == here or "mark.nightly" not in text:
            continue
        parts = path.relative_to(ROOT).parts
        in_unit_line = parts[1] == "unit" and "mark.multigpu" not in text
        if parts[1] != "multigpu" and not in_unit_line:
            elsewhere.append(path.relative_to(ROOT))
    assert elsewhere == [], f"marked nightly where no nightly line runs it: {elsewhere}"


def test_the_pull_request_job_runs_the_unit_tests_the_fast_tier_leaves_out():
    """``bash ci/unit.sh`` leaves the tests marked ``slow`` out unless ``QWZ_SLOW_TESTS=1``;
    the pull-request job sets it, so a slow unit test still runs on every pull request."""
    script = (ROOT / "ci" / "unit.sh").read_text()
    assert 'markers="not multigpu and not slow"' in script
    assert '[ "${QWZ_SLOW_TESTS:-0}" = "1" ] && markers="not multigpu"' in script
    ci = load(ROOT / ".github" / "workflows" / "ci.yml")
    step = next(s for s in ci["jobs"]["unit"]["steps"] if "ci/unit.sh" in s.get("run", ""))
    assert step.get("env", {}).get("QWZ_SLOW_TESTS") == "1", step


KEEPS_ITS_WORKER = """
import os, pathlib
import pytest

@pytest.mark.parametrize("i", range(4))
def test_one(i):
    with open(pathlib.Path(__file__).with_suffix(".workers"), "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def args_of_the_test_command() -> list[str]:
    """The arguments ``ci/test.sh`` (the test command) gives ``python -m pytest``."""
    command = (ROOT / "ci" / "test.sh").read_text()
    line = next(line for line in command.splitlines() if "-m pytest" in line)
    return shlex.split(line.split("-m pytest", 1)[1].split("||")[0])


def test_the_test_command_runs_each_file_on_one_worker(tmp_path):
    """A multigpu file's ranks, checkouts and module fixtures are made once only if all its
    tests run on one xdist worker: the test command's own distribution flags, on two files of
    four tests, keep each file's tests together (under pytest 9, ``--dist loadgroup`` did not:
    pytest-xdist#1386)."""
    words = args_of_the_test_command()
    flags = [word for i, word in enumerate(words) if word in ("-n", "--dist") or (
        i > 0 and words[i - 1] in ("-n", "--dist"))]  # fmt: skip
    assert "--dist" in flags, f"the test command names no --dist mode: {words}"
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(KEEPS_ITS_WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *flags, "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for name in ("test_a", "test_b"):
        workers = (tmp_path / f"{name}.workers").read_text().split()
        assert len(workers) == 4 and len(set(workers)) == 1, (name, workers)


def _qwz_qualify_lines(script: str) -> list[str]:
    """The ``qwz-qualify`` command lines of a ci/ script, continuation lines joined."""
    text = (ROOT / "ci" / script).read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("qwz-qualify ")]


def test_the_main_job_keeps_every_run_and_names_what_it_writes():
    """Re-running the main job replaced the previous record (it passed --force); its header
    listed two plots, it writes four ([Note: results kept], evidence/run_dir.py)."""
    from qwz.qualify.evidence import run_dir

    [run] = _qwz_qualify_lines("qualify-cpu.sh")
    assert "--force" not in shlex.split(run) and "--keep-previous" in shlex.split(run), run
    header = "".join(
        line for line in (ROOT / "ci" / "qualify-cpu.sh").read_text().splitlines()
        if line.startswith("#")
    )  # fmt: skip
    missing = [name for name in run_dir.RUN_FILES if name not in header]
    assert not missing, f"ci/qualify-cpu.sh's header does not name {missing}"


def test_the_nightly_replaces_its_baseline_only_where_asked_to():
    """``promote`` refuses to replace a baseline without --force: the nightly passes it on
    QWZ_PROMOTE=1 alone, not where it starts a spec's first baseline."""
    promotes = [line for line in _qwz_qualify_lines("nightly.sh") if " promote " in line]
    assert len(promotes) == 2, promotes
    script = (ROOT / "ci" / "nightly.sh").read_text()
    forced = script[script.index('"${QWZ_PROMOTE:-0}" = "1"') :].split("elif")[0]
    assert "promote --force" in forced
    first = script[script.index('"${QWZ_NEW_BASELINE:-0}" = "1"') :].split("else")[0]
    assert "promote" in first and "--force" not in first
