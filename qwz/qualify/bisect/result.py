"""``bisect.json`` and ``bisect.md``: every commit tested with its verdict for the oracle and
its record's digest, and the answer (the first bad commit with its subject line and diff
stat, or the range skipped commits hide it in)."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.bisect import first_parents


def _commit(repository: pathlib.Path, sha: str) -> dict[str, str]:
    return {"sha": sha, "subject": first_parents.subject_line(repository, sha)}


class Summary:
    """The result of one invocation, filled in as the bisect goes."""

    def __init__(self, request: dict[str, Any], out: pathlib.Path, started: float):
        self.request, self.out, self.started = request, out, started
        self.repository = pathlib.Path(request["repository"])
        self.oracle: dict[str, Any] | None = None
        self.first_bad: dict[str, str] | None = None
        self.candidates: list[dict[str, str]] = []

    def found(self, sha: str) -> None:
        self.first_bad = {
            **_commit(self.repository, sha),
            "diff_stat": first_parents.diff_stat(self.repository, sha),
        }
        self.candidates = [_commit(self.repository, sha)]

    def hidden(self, shas: list[str]) -> None:
        self.candidates = [_commit(self.repository, sha) for sha in shas]

    def write(self, session, status: str, why: str, exit_code: int) -> int:
        """Write both files; print where, and the answer; return `exit_code`."""
        tested = [
            {**_commit(self.repository, sha), "attempts": entries}
            for sha, entries in session.tested.items()
        ]
        payload = {
            "status": status,
            "why": why,
            "exit_code": exit_code,
            "request": self.request,
            "oracle": self.oracle,
            "first_bad": self.first_bad,
            "candidates": self.candidates,
            "tested": tested,
            "qualifications_run": session.ran,
            "qualifications_reused": len(session.reused_from_before),
            "wall_s": round(time.monotonic() - self.started, 1),
        }
        atomic_write_text(self.out / "bisect.json", json.dumps(payload, indent=2) + "\n")
        atomic_write_text(self.out / "bisect.md", render_markdown(payload))
        if why:  # a refusal in the one error style ([Note: one error style], cli_parser.py)
            print(f"qwz-qualify bisect: error: {status}: {why}", file=sys.stderr)
        print(f"wrote {self.out / 'bisect.json'} and {self.out / 'bisect.md'}: {headline(payload)}")
        return exit_code


def headline(payload: dict[str, Any]) -> str:
    first_bad = payload["first_bad"]
    if first_bad is not None:
        return f"first bad commit {first_bad['sha'][:12]} {first_bad['subject']}"
    if payload["status"] == "hidden by skipped commits":
        return (
            f"the first bad commit is one of {len(payload['candidates'])} (skipped commits hide it)"
        )
    return f"{payload['status']}: {payload['why']}"


def _oracle_line(oracle: dict[str, Any] | None) -> str:
    if oracle is None:
        return "not established"
    if oracle["kind"] == "check":
        return "check " + ", ".join(f"`{name}`" for name in oracle["checks"]) + " fails"
    if oracle["kind"] == "hash":
        return "final hashes differ from the good head's"
    return "speed-up interval entirely below the good head's"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(payload: dict[str, Any]) -> str:
    request = payload["request"]
    lines = [f"# qwz-qualify bisect: {headline(payload)}", ""]
    lines += [
        f"Repository `{request['repository']}`, good `{request['good'][:12]}`, bad "
        f"`{request['bad'][:12]}`, subject `{request['subject']}`; oracle: "
        f"{_oracle_line(payload['oracle'])}; run arguments `{' '.join(request['run_args'])}`.",
        f"{payload['qualifications_run']} qualifications run, "
        f"{payload['qualifications_reused']} reused from the directory, {payload['wall_s']} s.",
        "",
    ]
    if payload["first_bad"] is not None:
        first_bad = payload["first_bad"]
        lines += ["## First bad commit", "", f"`{first_bad['sha']}` {first_bad['subject']}", ""]
        lines += ["```", first_bad["diff_stat"], "```", ""]
    elif payload["candidates"]:
        lines += ["## Skipped commits hide the first bad commit; it is one of", ""]
        lines += [f"- `{item['sha'][:12]}` {item['subject']}" for item in payload["candidates"]]
        lines.append("")
    lines += ["## Commits tested (in the order tested)", ""]
    lines += [
        "| commit | subject | attempt | verdict | record digest | why |",
        "|---|---|---|---|---|---|",
    ]
    for commit in payload["tested"]:
        for entry in commit["attempts"]:
            digest = f"`{entry['digest'][:12]}`" if entry["digest"] else "none"
            lines.append(
                f"| `{commit['sha'][:12]}` | {_cell(commit['subject'])} | {entry['attempt']} | "
                f"{entry['verdict']} | {digest} | {_cell(entry['why'])} |"
            )
    return "\n".join(lines) + "\n"
