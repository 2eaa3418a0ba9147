"""The review's request: the run options both runs get, what the review sets itself, and the
request on disk, so a review resumes ([Note: review resume] in qualify/pr_review/__init__.py)::

    <out>/request.json        the repository, both refs and SHAs, the worktree, the run options
    <out>/base/, <out>/head/  each run's record, report and plots
    <out>/logs/               each run's output
    <out>/pr-tests/           the PR's own tests: each side's result, pytest's JUnit XML, logs
    <out>/review.md, review.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import shutil
from typing import Any, NamedTuple

from qwz import jsonio
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.request.settings import run_settings

SUBJECT = "deepspeed-native"
PR_GROUP_SIZES = (64, 8192)
"""The group sizes of the PR's own evidence (its probe saw 64 and 8192 on every rank): the
head's candidates unless the run options name others."""
REVIEW_SETTINGS = ("subject", "deepspeed_src", "arm_set")
"""Run settings the review sets itself ([Note: the base runs the reference alone])."""
NOT_APPLICABLE = {
    "qwz_gather": "does not apply to a review: every arm is DeepSpeed's own code (the subject "
    f"is {SUBJECT}), never qwz's gather",
}
"""Run settings that cannot apply to a review, refused with why (name -> why)."""
SHOWN_DEFAULTS = {
    "group_sizes": f"{' '.join(map(str, PR_GROUP_SIZES))}, the PR's own evidence",
}
"""What ``review --help`` shows as a run setting's default where the review's differs from
``run``'s (name -> text)."""
REVIEW_FLAGS = ("--out", "--force")
"""``run`` flags that are no settings and the review's to set."""
REQUEST_KEYS = ("repository", "base", "head", "worktree", "run_args", "min_speedup")
"""What a resumed review must share with the one that made the directory (the refs' names
are not among them: what they named, the SHAs, is)."""
OUTPUTS = ("base", "head", "logs", "pr-tests", "review.md", "review.json")


class Refused(Exception):
    """The request cannot be served; the message says why (exit 2)."""


class RunOptions(NamedTuple):
    common: list[str]
    """Both runs' arguments: every run setting given, as ``run`` flags, in declaration
    order (the PR's group sizes where none was given); ``--min-speedup`` apart."""
    min_speedup: float | None


def _given_as_flags(args: argparse.Namespace) -> list[str]:
    """The run settings given to ``review`` as its own flags, as ``run`` arguments."""
    settings = run_settings()
    return [
        token
        for name, setting in settings.items()
        if getattr(args, name, None) is not None
        for token in setting.arguments(getattr(args, name))
    ]


def _parsed_run(parser: argparse.ArgumentParser, arguments: list[str]) -> argparse.Namespace:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(["run", "--out", os.devnull, *arguments])
    except SystemExit:
        said = [line for line in errors.getvalue().splitlines() if "error:" in line]
        raise Refused(said[-1].split("error: ", 1)[-1] if said else "bad run options") from None


def run_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunOptions:
    """The run options of the request (flags of ``review`` and arguments after ``--``),
    checked by ``run``'s own parser; Refused for an option the review sets itself."""
    for flag in REVIEW_FLAGS:
        if any(item == flag or item.startswith(flag + "=") for item in args.run_args):
            raise Refused(f"{flag} is the review's to set, not a run option")
    parsed = _parsed_run(parser, [*_given_as_flags(args), *args.run_args])
    settings = run_settings()
    given = [name for name in settings if getattr(parsed, name) is not None]
    for name in given:
        if name in NOT_APPLICABLE:
            raise Refused(f"{settings[name].flag} {NOT_APPLICABLE[name]}")
    for name in REVIEW_SETTINGS:
        if name in given:
            raise Refused(
                f"{settings[name].flag} is the review's to set (the subject is {SUBJECT}, "
                "the source the review's worktree, the arms the reference at the base and "
                "every arm at the head), not a run option"
            )
    common = [
        token
        for name in given
        if name != "min_speedup"
        for token in settings[name].arguments(getattr(parsed, name))
    ]
    if "group_sizes" not in given:
        common += settings["group_sizes"].arguments(PR_GROUP_SIZES)
    return RunOptions(common, parsed.min_speedup)


def side_arguments(options: RunOptions, side: str, worktree: pathlib.Path) -> list[str]:
    """The ``run`` arguments of the base or the head ([Note: the base runs the reference
    alone]), without ``--out``."""
    arguments = [*options.common, "--subject", SUBJECT, "--deepspeed-src", str(worktree)]
    arguments += ["--arm-set", "reference" if side == "base" else "all"]
    if side == "head" and options.min_speedup is not None:
        arguments += ["--min-speedup", repr(options.min_speedup)]
    return arguments


def _differing(stored: dict[str, Any], request: dict[str, Any]) -> list[str]:
    return [key for key in REQUEST_KEYS if stored.get(key) != request.get(key)]


def claim(out: pathlib.Path, request: dict[str, Any], restart: bool) -> bool:
    """Write ``request.json`` into `out`, or check the one there is the same request; True
    when the directory was already this request's (a resume). With `restart`, the runs and
    the summary of whatever request the directory held are discarded first."""
    path = out / "request.json"
    if restart and path.exists():  # a review's directory: its runs and summary are its own
        discard(out)
    if path.exists():
        try:
            stored = jsonio.read_json_file(path, what="review request")
        except jsonio.JsonInputError as error:
            raise Refused(f"{error}; use --restart to start over") from None
        differing = _differing(stored, request)
        if differing:
            raise Refused(
                f"{out} holds a review of another request ({', '.join(differing)} differ: "
                f"stored {[stored.get(key) for key in differing]}, asked "
                f"{[request.get(key) for key in differing]}); use --restart to discard its "
                "runs, or a new --out"
            )
        return True
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(request, indent=2) + "\n")
    return False


def discard(out: pathlib.Path) -> None:
    """Remove the runs and the summary of the review in `out` (never the worktree)."""
    for name in OUTPUTS:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    (out / "request.json").unlink(missing_ok=True)
