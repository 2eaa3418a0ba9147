"""A short Python child process that reports one JSON answer on its stdout.

The harness asks questions it must not answer in its own process -- what a DeepSpeed checkout
imports as, what its config accepts (run/subjects.py, run/conformance_run.py) -- in a child with
the import path the ranks get. The child prints its answer as one line, ``marker`` followed
by JSON, among whatever the code it imports prints; :func:`ask` returns that answer or, as a
:class:`NoAnswer`, why there is none, so each caller can word its own harness error.

Where [Note: forked children] (run/forking.py) allows, the child is this process forked and
made to look like ``python -c``; either way its answer is read the same.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from qwz.qualify.run import forking


class NoAnswer(NamedTuple):
    """Why a child gave no answer."""

    kind: str
    """"timeout", "start" (it could not be started) or "exit" (it ended without one)."""
    message: str
    """The timeout, the OS error, or the last line of its stderr."""


def ask(
    script: str,
    *,
    marker: str,
    environment: dict[str, str],
    timeout_s: float,
    stdin_text: str | None = None,
    fresh: Sequence[str] = (),
) -> Any:
    """Run ``python -c script`` with `environment` and `stdin_text` (forked where [Note: forked
    children] allows and no module of `fresh` is imported here); the JSON of its last line
    that starts with `marker`, or a :class:`NoAnswer`."""
    try:
        if forking.sound() and not any(name in sys.modules for name in fresh):
            done = forking.python_c(script, environment, timeout_s, stdin_text)
        else:
            done = _interpreter(script, environment, timeout_s, stdin_text)
    except OSError as error:
        return NoAnswer("start", str(error))
    if done is None:
        return NoAnswer("timeout", f"over {timeout_s:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return NoAnswer("exit", f"exited {done.returncode}: {last[:500]}")
    try:
        return json.loads(lines[-1].removeprefix(marker))
    except ValueError as error:
        return NoAnswer("exit", f"its answer is not JSON: {error}"[:500])


def imported_from_path(name: str, path: list[str]) -> bool:
    """Whether the top-level module `name` is imported here from the file that `path` (a
    ``sys.path``) would import it from."""
    module = sys.modules.get(name)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    origin = None if spec is None else spec.origin
    here = getattr(module, "__file__", None)
    return bool(origin and here) and os.path.realpath(origin) == os.path.realpath(here)


def _interpreter(
    script: str, environment: dict[str, str], timeout_s: float, stdin_text: str | None
) -> forking.Ended | None:
    """``python -c script`` in a new interpreter; None when it outlasted `timeout_s`."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            input=stdin_text,
            capture_output=True,
            text=True,
            env=environment,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return forking.Ended(done.returncode, done.stdout, done.stderr)
