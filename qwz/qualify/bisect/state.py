"""A bisect's directory: the request it answers and every attempt it made ([Note: records
are the state] in qualify/bisect/__init__.py)::

    <out>/request.json                          what is bisected, by which harness
    <out>/harness/qualify/                      the harness snapshot
    <out>/commits/<sha>/attempt-<n>/record.json a trial's record (its report and plots beside)
    <out>/commits/<sha>/attempt-<n>/outcome.json how the trial ended (exit code, why, seconds)
    <out>/commits/<sha>/attempt-<n>/run.log     the trial's output
    <out>/bisect.json, <out>/bisect.md          the result
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, NamedTuple

from qwz import jsonio
from qwz.qualify.base.files import atomic_write_text

REQUEST_KEYS = ("repository", "good", "bad", "subject", "run_args", "setup", "harness_digest")
"""What a resumed bisect must share with the one that made the directory (the oracle is not
among them: records do not depend on it)."""


class RequestError(ValueError):
    """The directory belongs to another request; the message names what differs."""


def claim(out: pathlib.Path, request: dict[str, Any]) -> bool:
    """Write ``request.json`` into `out`, or check the one there is the same request; True
    when the directory was already this request's (a resume)."""
    path = out / "request.json"
    if path.exists():
        try:
            stored = jsonio.read_json_file(path, what="bisect request")
        except jsonio.JsonInputError as error:
            raise RequestError(str(error)) from None
        differing = [key for key in REQUEST_KEYS if stored.get(key) != request.get(key)]
        if differing:
            raise RequestError(
                f"{out} holds a bisect of another request ({', '.join(differing)} differ: "
                f"stored {[stored.get(key) for key in differing]}, asked "
                f"{[request.get(key) for key in differing]}); use a new --out"
            )
        return True
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(request, indent=2) + "\n")
    return False


class Attempt(NamedTuple):
    """One qualification of one commit: its directory, and whether it finished."""

    sha: str
    directory: pathlib.Path

    @property
    def record(self) -> pathlib.Path:
        return self.directory / "record.json"

    @property
    def outcome_path(self) -> pathlib.Path:
        return self.directory / "outcome.json"

    @property
    def finished(self) -> bool:
        """A record, or an outcome saying why there is none: either way nothing to re-run."""
        return self.record.is_file() or self.outcome_path.is_file()

    def outcome(self) -> dict[str, Any]:
        """How the trial ended; {} when its outcome was never written (killed after the
        record was, which is all a judgement needs)."""
        if not self.outcome_path.is_file():
            return {}
        return jsonio.read_json_file(self.outcome_path, what="trial outcome")

    def write_outcome(self, outcome: dict[str, Any]) -> None:
        atomic_write_text(self.outcome_path, json.dumps(outcome, indent=2) + "\n")


def attempts(out: pathlib.Path, sha: str) -> list[Attempt]:
    """The finished attempts of `sha`, oldest first."""
    directory = out / "commits" / sha
    found = [
        Attempt(sha, path)
        for path in directory.glob("attempt-*")
        if path.name.removeprefix("attempt-").isdigit()
    ]
    found.sort(key=lambda attempt: int(attempt.directory.name.removeprefix("attempt-")))
    return [attempt for attempt in found if attempt.finished]


def next_attempt(out: pathlib.Path, sha: str) -> Attempt:
    """A fresh attempt directory for `sha` (an unfinished one left by an interruption is
    reused: it holds no record and no outcome)."""
    number = len(attempts(out, sha)) + 1
    attempt = Attempt(sha, out / "commits" / sha / f"attempt-{number}")
    attempt.directory.mkdir(parents=True, exist_ok=True)
    return attempt
