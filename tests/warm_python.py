"""``python -c`` and ``python -m qwz.qualify`` for the tests, forked from a warm interpreter.

[Note: the tests' warm interpreter]
Most of the suite's CLI tests run ``python -m qwz.qualify ...`` or ``python -c ...`` in a new
interpreter, which imports torch, ``torch._dynamo`` (the ranks' modules, imported before they
fork), matplotlib (the plots) and qwz again before it does anything: about 4 s of CPU a run on
the 2-core CI machine, most of a short run's own CPU. A pytest-xdist worker has several
threads, so it may not fork those children itself ([Note: forking is sound],
qwz/qualify/run/forking.py). Each worker therefore starts one helper interpreter, single
threaded, that imports those modules once (:data:`PRELOAD`) and forks every child from there
with qwz's own forked ``python -c`` (:func:`qwz.qualify.run.forking.python_c`, [Note: forked
children]): the environment replaced by the test's, its working directory and arguments set,
stdin, stdout and stderr on pipes, a timeout killing it as ``subprocess.run`` does.

What the helper has imported was imported under its own environment, so a child is forked
only where that cannot matter; everywhere else :func:`run` starts a new interpreter, as before:

- the helper may fork (:func:`forking.sound`: Linux, one thread, no GPU, no process group);
- the child's environment differs from the helper's only in variables read when they are
  used, not at import (:data:`READ_AT_USE`): ``ATEN_CPU_CAPABILITY``, ``OMP_NUM_THREADS`` and
  the like are read when torch is imported, so a test that sets them gets a new interpreter;
- no ``PYTHONPATH`` entry of the child holds another ``qwz`` (a bisect's worktree imports its
  own) or a ``sitecustomize`` (run when an interpreter starts), and ``deepspeed`` is not
  among the helper's modules: a child imports the DeepSpeed its path names, as a new
  interpreter would.

A test that asserts what an interpreter has imported, or blocks an import before qwz's,
keeps ``subprocess.run``.

A helper that ends while a child runs is an error of that test (the child may have run, so
it is not run again), and the next child gets a new helper; one that never got through its
imports is not started again. When the worker's own environment changes outside
:data:`READ_AT_USE` (torch sets ``TORCHINDUCTOR_CACHE_DIR`` at its first compile), the idle
helper is replaced by one started under the new environment. ``QWZ_TEST_WARM_PYTHON=0``
turns the helper off (every child a new interpreter).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import pickle
import subprocess
import sys
import threading

WORKTREE = pathlib.Path(__file__).resolve().parents[1]
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "qwz.qualify.cli",
    "qwz.qualify.run.runner",
)
"""What a CLI run imports: torch, the modules its ranks import before they fork
(qwz/qualify/cli.py ``_rank_imports``), the plots' matplotlib, the CLI and the runner."""
READ_AT_USE = frozenset(
    {"PYTHONPATH", "PYTHONUNBUFFERED", "DS_ACCELERATOR", "QWZ_BACKEND", "TORCH_EXTENSIONS_DIR",
     "PYTEST_CURRENT_TEST"}
)  # fmt: skip
"""Variables a child may set differently from the helper: read by the code that uses them
(the import path when the child imports, DeepSpeed's accelerator and qwz's backend when a
rank starts, the JIT build's directory when it builds), not by an import the helper did;
and pytest's name of the running test, which it changes before every test."""
AT_START = ("sitecustomize.py", "usercustomize.py")
"""Modules Python imports from the path when it starts, never in a forked child."""


def run(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` for
    `args` ``["-c", code, *argv]`` or ``["-m", "qwz.qualify", *argv]``: a child forked from
    this worker's warm interpreter where [Note: the tests' warm interpreter] allows it, else
    a new interpreter. Raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
    environment = dict(os.environ if env is None else env)
    directory = os.path.abspath(cwd if cwd is not None else os.getcwd())
    script = _script(args, directory)
    helper = _helper() if script is not None else None
    ended = False
    if helper is not None and helper.may_fork(environment):
        ended = helper.ask(script, environment, timeout, input)
    if ended is False:  # not forked: a new interpreter
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, env=environment,
            cwd=directory, timeout=timeout, input=input, check=False,
        )  # fmt: skip
    if ended is None:
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
    return subprocess.CompletedProcess(
        [sys.executable, *args], ended.returncode, ended.stdout, ended.stderr
    )


def _script(args: list[str], directory: str) -> str | None:
    """The ``python -c`` script that runs `args` in `directory`, or None for other args."""
    prologue = f"import os, sys\nos.chdir({directory!r})\nsys.argv[1:] = {args[2:]!r}\n"
    if args[:1] == ["-c"] and len(args) >= 2:
        body = f"exec(compile({args[1]!r}, '<string>', 'exec'), {{'__name__': '__main__'}})\n"
        return prologue + body
    if args[:2] == ["-m", "qwz.qualify"]:
        runner = (
            "import runpy\nrunpy.run_module('qwz.qualify', run_name='__main__', alter_sys=True)\n"
        )
        return prologue + runner
    return None


class _Helper:
    """The warm interpreter: requests in, answers out, on two pipes of its own."""

    def __init__(self) -> None:
        self.environment = _helper_environment()
        requests_r, self._requests = os.pipe()
        self._answers, answers_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.warm_python import serve; "
             "serve(int(sys.argv[1]), int(sys.argv[2]))", str(requests_r), str(answers_w)],
            cwd=WORKTREE, pass_fds=(requests_r, answers_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, env=self.environment,
        )  # fmt: skip
        os.close(requests_r)
        os.close(answers_w)
        self._writer = os.fdopen(self._requests, "wb")
        self._reader = os.fdopen(self._answers, "rb")
        self._lock = threading.Lock()
        self.ready = False
        self.gone = False

    def may_fork(self, environment: dict[str, str]) -> bool:
        """Whether a child with `environment` may be forked from this helper: it differs
        from the helper's own only in :data:`READ_AT_USE`, and no ``PYTHONPATH`` entry holds
        a ``qwz`` other than this worktree's or a module Python runs only when it starts."""
        if not _same_at_import(environment, self.environment):
            return False
        for entry in filter(None, environment.get("PYTHONPATH", "").split(os.pathsep)):
            path = pathlib.Path(entry)
            if any((path / name).exists() for name in AT_START):
                return False
            if (path / "qwz").is_dir() and path.resolve() != WORKTREE:
                return False
        return True

    def ask(self, script, environment, timeout, stdin_text):
        """The child's ``forking.Ended``, None past `timeout`, or False: not forked (the
        helper may not fork now, or it is gone). A helper that dies after it took the
        request is an error: the child may have run, so it is not run again."""
        with self._lock:
            if not self.ready:  # its first word: ready, after its imports
                try:
                    self.ready = pickle.load(self._reader) is True
                except (OSError, EOFError, pickle.UnpicklingError):
                    self.gone = True
                    return False
            try:
                pickle.dump((script, environment, timeout, stdin_text), self._writer)
                self._writer.flush()
            except OSError:
                self.gone = True
                return False
            try:
                return pickle.load(self._reader)
            except (OSError, EOFError, pickle.UnpicklingError) as error:
                self.gone = True  # its pipe is closed; its exit may not be reaped yet
                raise RuntimeError(
                    f"the tests' warm interpreter (pid {self.process.pid}) ended while it ran "
                    f"a child; its exit status: {self.process.poll()}"
                ) from error

    def close(self) -> None:
        for stream in (self._writer, self._reader):
            with contextlib.suppress(OSError):
                stream.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _helper_environment() -> dict[str, str]:
    """The environment a helper started now gets: this worker's, with the worktree first on
    the import path."""
    path = [str(WORKTREE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _same_at_import(one: dict[str, str], other: dict[str, str]) -> bool:
    """Whether two environments agree in every variable outside :data:`READ_AT_USE`."""
    keys = (set(one) | set(other)) - READ_AT_USE
    return all(one.get(key) == other.get(key) for key in keys)


_HELPER: list[_Helper | None] = []


def _helper() -> _Helper | None:
    """This process's helper, started on first use and again when the last one ended or this
    worker's own environment changed since it started (None where it is turned off or cannot
    start)."""
    current = _HELPER[0] if _HELPER else None
    # torch sets TORCHINDUCTOR_CACHE_DIR in the worker at its first compile, and
    # PYTORCH_NVML_BASED_CUDA_CHECK at its first CUDA check: from then on a helper started
    # before could fork none of the worker's children. Between children it is idle: replaced.
    drifted = current is not None and not _same_at_import(
        current.environment, _helper_environment()
    )
    if current is not None and (current.gone or drifted):
        _HELPER.pop()
        current.close()
        if current.gone and not current.ready:  # it never got through its imports
            _HELPER.append(None)  # no other one would: children are new interpreters
    if not _HELPER:
        off = os.environ.get("QWZ_TEST_WARM_PYTHON", "1") == "0"
        try:
            _HELPER.append(None if off or not sys.platform.startswith("linux") else _Helper())
        except OSError:
            _HELPER.append(None)
        if _HELPER[0] is not None:
            atexit.register(_HELPER[0].close)
    return _HELPER[0]


def serve(requests_fd: int, answers_fd: int) -> None:
    """The helper's loop: import :data:`PRELOAD`, then fork a child per request, until the
    worker closes the requests pipe. Answers False where it may not fork."""
    import importlib

    for name in PRELOAD:
        # Without an extra (matplotlib, say) a child fails to import it as a new one would.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    from qwz.qualify.run import forking

    # deepspeed must come from each child's own path: imported here, no child may be forked.
    path_free = "deepspeed" not in sys.modules
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(answers_fd, "wb") as answers:
        pickle.dump(True, answers)
        answers.flush()
        while True:
            try:
                script, environment, timeout, stdin_text = pickle.load(requests)
            except EOFError:
                return
            answer = False
            if path_free and forking.sound():
                answer = forking.python_c(script, environment, timeout, stdin_text)
            pickle.dump(answer, answers)
            answers.flush()
