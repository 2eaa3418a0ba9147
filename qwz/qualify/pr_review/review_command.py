"""``qwz-qualify review --repo PATH --base REF --head REF --out DIR [run options]``: the command
(cli.py hands it the parsed arguments and its parser, so this package never imports the CLI).

Exit status: the review's (qualify/review/pr_review.py): 0 PASS, 1 FAIL, 3 INCONCLUSIVE,
4 HARNESS-ERROR, 2 refused (a bad ref or run option, a directory of another request, a
run's own refusal); 128 + the signal when SIGINT/SIGTERM stopped it (finished runs are kept:
the same command continues, [Note: review resume] in qualify/pr_review/__init__.py).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

from qwz.qualify.base.files import writable_directory_problem
from qwz.qualify.base.supervise import Stop
from qwz.qualify.bisect.first_parents import GitError, commit_sha, top_level
from qwz.qualify.evidence.default_path import compare_default_path
from qwz.qualify.evidence.schema import Record
from qwz.qualify.pr_review import checkout, children, own_tests, request
from qwz.qualify.review import own_tests_section as own_test_results
from qwz.qualify.review import pr_review
from qwz.qualify.review.claims import claims_table
from qwz.qualify.review.own_tests_section import OwnTests
from qwz.qualify.review.own_tests_section import claim_rows as own_test_rows
from qwz.qualify.review.pr_review import REFUSED, Review, Side


def _say(text: str) -> None:
    print(f"qwz-qualify review: {text}", file=sys.stderr, flush=True)


def _resolved(args: argparse.Namespace) -> tuple[pathlib.Path, str, str]:
    """The repository's root and the SHAs of the base and the head; Refused with a line per
    ref that names no commit there."""
    try:
        repository = top_level(args.repo)
    except GitError:
        raise request.Refused(f"--repo {args.repo} is not a git repository") from None
    shas, problems = [], []
    for flag, ref in (("--base", args.base), ("--head", args.head)):
        try:
            shas.append(commit_sha(repository, ref))
        except GitError:
            problems.append(f"{flag} {ref} is not a commit in {repository}")
    if problems:
        raise request.Refused("\n".join(problems))
    base, head = shas
    if base == head:
        raise request.Refused(f"--base {args.base} and --head {args.head} are one commit")
    return repository, base, head


def _open(args: argparse.Namespace, parser):
    """The request (checked, claimed in ``--out``), the run options and the own tests' plan;
    Refused with why."""
    options = request.run_options(args, parser)
    problem = writable_directory_problem(args.out, "--out")
    if problem:
        raise request.Refused(problem)
    repository, base, head = _resolved(args)
    try:
        step = own_tests.plan(args, repository, base, head)
    except own_tests.Refused as error:
        raise request.Refused(str(error)) from None
    worktree = (args.worktree or args.out / "worktree").absolute()
    problem = checkout.problem(repository, worktree)
    if problem:
        raise request.Refused(problem)
    wanted = {
        "repository": str(repository),
        "base_ref": args.base,
        "head_ref": args.head,
        "base": base,
        "head": head,
        "worktree": str(worktree),
        "run_args": options.common,
        "min_speedup": options.min_speedup,
    }
    if request.claim(args.out, wanted, args.restart):
        _say(f"resuming the review in {args.out} (finished runs are reused)")
    return wanted, options, step


def _runs(wanted: dict[str, Any], options: request.RunOptions, out: pathlib.Path):
    worktree = pathlib.Path(wanted["worktree"])
    return [
        children.Run(
            side,
            wanted[f"{side}_ref"],
            wanted[side],
            request.side_arguments(options, side, worktree),
            out,
        )
        for side in ("base", "head")
    ]


def _one(run: children.Run, parser, wanted: dict[str, Any], stop: Stop, launcher):
    """The run's finished record reused, or the run now ([Note: review resume])."""
    record, _ = children.finished(run, parser)
    if record is not None:
        return children.resumed(run, record), record
    _say(f"qualifying the {run.side} {run.ref} ({run.sha[:12]}) ...")
    worktree = (pathlib.Path(wanted["repository"]), pathlib.Path(wanted["worktree"]))
    try:
        return children.launch(run, parser, worktree, stop, launcher)
    except GitError as error:  # the worktree could not be made: nothing ran
        return children.not_run(run, f"git: {error}", REFUSED), None


def _review(
    wanted: dict[str, Any], sides: list[Side], records: dict[str, Record], own: OwnTests
) -> Review:
    base, head = records.get("base"), records.get("head")
    default_path = compare_default_path(base, head) if base and head else None
    claims = claims_table(head, base, default_path) if head else []
    claims += own_test_rows(own)
    return Review(wanted, tuple(sides), tuple(claims), default_path, own)


def _own_tests(step, wanted, sides: list[Side], out, stop: Stop, test_launcher) -> OwnTests:
    """[Note: the PR's own tests], unless the review was refused or stopped."""
    if any(side.status == REFUSED for side in sides):
        return own_test_results.not_run("the review was refused")
    if stop.signum is not None:
        return own_test_results.not_run("the review was stopped before them")
    return own_tests.review_tests(step, wanted, out, stop, _say, test_launcher)


def run_review(
    args: argparse.Namespace,
    parser,
    launcher=children.subprocess_launcher,
    test_launcher=own_tests.subprocess_launcher,
) -> int:
    """The review of ``args`` (module docstring); its exit status."""
    try:
        wanted, options, step = _open(args, parser)
    except request.Refused as error:
        for line in str(error).splitlines():
            _say(f"refused: {line}")
        return 2
    try:
        return _reviewed(args, parser, (wanted, options, step), launcher, test_launcher)
    finally:  # every path, a signal's included ([Note: one worktree per review])
        if args.worktree is None:
            repository, worktree = pathlib.Path(wanted["repository"]), wanted["worktree"]
            why = checkout.remove(repository, pathlib.Path(worktree))
            if why is not None:
                _say(f"the worktree {worktree} could not be removed: {why}")


def _reviewed(args, parser, opened, launcher, test_launcher) -> int:
    """The review's runs and the PR's own tests, its summary written and printed; its exit
    status."""
    wanted, options, step = opened
    sides: list[Side] = []
    records: dict[str, Record] = {}
    stop = Stop()
    with stop.installed():
        for run in _runs(wanted, options, args.out):
            if stop.signum is not None or (sides and sides[-1].status == REFUSED):
                why = "stopped before it ran" if stop.signum else "the base's run was refused"
                sides.append(children.not_run(run, why))
                continue
            started = time.monotonic()
            side, record = _one(run, parser, wanted, stop, launcher)
            _say(f"{run.side}: {side.status} ({side.kind}, {time.monotonic() - started:.0f} s)")
            sides.append(side)
            if record is not None:
                records[run.side] = record
        own = _own_tests(step, wanted, sides, args.out, stop, test_launcher)
    review = _review(wanted, sides, records, own)
    pr_review.write(args.out, review)
    print(pr_review.render_claims(review), end="")
    status = pr_review.status_of(review)
    print(f"wrote {args.out / pr_review.MARKDOWN} and {args.out / pr_review.JSON}; {status}")
    return 128 + stop.signum if stop.signum is not None else pr_review.exit_code(review)
