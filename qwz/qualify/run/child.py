"""A short Python child process that reports one JSON answer on its stdout.

The harness asks questions it must not answer in its own process -- what a DeepSpeed checkout
imports as, what its config accepts (run/subjects.py, run/conformance.py) -- in a child with
the import path the ranks get. The child prints its answer as one line, ``marker`` followed
by JSON, among whatever the code it imports prints; :func:`ask` returns that answer or, as a
:class:`NoAnswer`, why there is none, so each caller can word its own harness error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, NamedTuple


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
) -> Any:
    """Run ``python -c script`` with `environment` and `stdin_text`; the JSON of its last line
    that starts with `marker`, or a :class:`NoAnswer`."""
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
        return NoAnswer("timeout", f"over {timeout_s:.0f} s")
    except OSError as error:
        return NoAnswer("start", str(error))
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return NoAnswer("exit", f"exited {done.returncode}: {last[:500]}")
    try:
        return json.loads(lines[-1].removeprefix(marker))
    except ValueError as error:
        return NoAnswer("exit", f"its answer is not JSON: {error}"[:500])
