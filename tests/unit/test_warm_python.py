"""The tests' warm interpreter (tests/warm_python.py): a child forked from it answers as a new
interpreter would, and a child it must not fork is a new interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import warm_python

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or torch.cuda.is_available()
    or os.environ.get("QWZ_TEST_WARM_PYTHON") == "0",
    reason="the warm interpreter forks only on Linux without a GPU ([Note: forking is sound]), "
    "and QWZ_TEST_WARM_PYTHON=0 turns it off",
)

WARM = "import sys; print('warm' if 'torch' in sys.modules else 'new')"
"""A new interpreter has not imported torch when its script starts; a warm child has."""


def _started(env=None) -> str:
    return warm_python.run(["-c", WARM], env=env, timeout=120).stdout.strip()


def test_a_child_answers_as_a_new_interpreter_would(tmp_path):
    script = (
        "import os, sys\n"
        "print(os.getcwd(), sys.argv[1:], os.environ['QWZ_BACKEND'], sys.stdin.read())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    for runner in (warm_python.run, _new_interpreter):
        done = runner(
            ["-c", script, "3", "x y"],
            env=dict(os.environ, QWZ_BACKEND="gloo"),
            cwd=tmp_path,
            timeout=120,
            input="from stdin",
        )
        assert done.returncode == 3, done.stderr
        assert done.stdout == f"{tmp_path} ['3', 'x y'] gloo from stdin\n"
        assert done.stderr == "to stderr\n"
    assert _started() == "warm"  # the first run was forked, not a new interpreter


def test_an_uncaught_exception_and_the_cli_s_usage_error_read_as_python_s(tmp_path):
    done = warm_python.run(["-c", "raise ValueError('bad')"], timeout=120)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: bad")
    args = ["-m", "qwz.qualify", "run", "--out", "unused", "--group-size", "60"]
    warm = warm_python.run(args, cwd=tmp_path, timeout=120)
    new = _new_interpreter(args, cwd=tmp_path, timeout=120)
    assert (warm.returncode, warm.stdout, warm.stderr) == (new.returncode, new.stdout, new.stderr)
    assert warm.returncode == 2 and "multiple of 8" in warm.stderr


def test_a_child_past_its_timeout_is_killed_and_raises():
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run(["-c", "import time; time.sleep(60)"], timeout=1)
    assert _started() == "warm"  # the helper goes on


def test_a_helper_that_dies_under_a_child_is_an_error_and_the_next_child_gets_a_new_one():
    """The child may have run: it is not run again in a new interpreter."""
    assert _started() == "warm"
    # Only a forked child kills its parent: a new interpreter's parent is this pytest worker.
    kill = (
        "import os, signal, sys\nif 'torch' in sys.modules: os.kill(os.getppid(), signal.SIGKILL)"
    )
    with pytest.raises(RuntimeError, match="warm interpreter"):
        warm_python.run(["-c", kill], timeout=120)
    assert _started() == "warm"


def test_a_change_of_the_workers_own_environment_gets_a_helper_started_under_it(monkeypatch):
    """torch sets TORCHINDUCTOR_CACHE_DIR in the worker at its first compile: the worker's
    children after that are still forked, from a helper that has the new environment."""
    assert _started() == "warm"
    monkeypatch.setenv("QWZ_TEST_A_VARIABLE_SET_IN_THE_WORKER", "1")
    assert _started() == "warm"
    done = warm_python.run(
        ["-c", "import os; print(os.environ['QWZ_TEST_A_VARIABLE_SET_IN_THE_WORKER'])"],
        timeout=120,
    )
    assert done.stdout == "1\n"


@pytest.mark.parametrize(
    "change",
    ["ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "sitecustomize", "another qwz"],
)
def test_a_child_the_helper_s_imports_would_misread_is_a_new_interpreter(tmp_path, change):
    env = dict(os.environ)
    if change in ("sitecustomize", "another qwz"):
        name = "sitecustomize.py" if change == "sitecustomize" else "qwz/__init__.py"
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    else:
        env[change] = "1" if change == "OMP_NUM_THREADS" else "default"
    assert _started(env) == "new"
    assert _started() == "warm"


def _new_interpreter(args, *, env=None, cwd=None, timeout, input=None):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=timeout, input=input, check=False,
    )  # fmt: skip
