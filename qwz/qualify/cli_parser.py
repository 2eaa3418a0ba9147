"""Every ``qwz-qualify`` command's arguments (``build_parser``), the parser they are built with,
and its one error style.

[Note: one error style]
Every refusal, whichever command and whichever layer finds it (argparse, the preflight, a
record that cannot be trusted, a file that cannot be written), is one line on stderr,
``qwz-qualify COMMAND: error: MESSAGE``, and the exit status 2 ([Note: exit statuses] in
qualify/base/exit_codes.py). :func:`refuse` prints it for the commands; :class:`Parser` for
argparse, with three more rules:

- No abbreviated flags (``allow_abbrev=False``): ``--ou DIR`` is not ``--out DIR``. A
  prefix that argparse expands silently could set a flag the user never named (``bisect``
  refuses ``--out``/``--force`` after ``--`` by their full names, which an abbreviation
  slipped past).
- A misspelt flag is refused with the flag it most resembles: ``--worklaod`` says
  ``did you mean --workload?``.
- ``--help`` shows every argument's default and ends with the exit-status table.
"""

from __future__ import annotations

import argparse
import difflib
import math
import pathlib
import sys
from typing import Any

from qwz.qualify.base import exit_codes
from qwz.qualify.base.values import (
    FINITE,
    NON_NEGATIVE,
    PATH,
    POSITIVE,
    POSITIVE_FINITE,
    Boolean,
    Real,
)
from qwz.qualify.request.settings import argparse_type

DESCRIPTION = "``qwz-qualify`` / ``python -m qwz.qualify``: run, matrix, report, compare."


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown (where it is None, the help says what that means); the
    description and the exit-status epilog keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """[Note: one error style]: a parser without abbreviations whose unknown flags get a
    suggestion, and whose help ends with the exit-status table."""

    def __init__(self, *args: Any, usage_error_status: int = exit_codes.REFUSED, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", exit_codes.epilog())
        super().__init__(*args, **kwargs)
        self.usage_error_status = usage_error_status
        """2; ``bisect-step``'s 128, which git reads as "abort" (2 would mark a commit bad)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(self.usage_error_status, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but arguments nobody took are refused by the command they were
        given to (its program name, its flags suggested), not by the top-level parser."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen_command(parsed) or self
            parser.error(unrecognized(extras, parser))
        return parsed

    def _chosen_command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None) or "")
        return None


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the closest flag of `parser` for
    each unknown one (``--worklaod`` -> ``did you mean --workload?``)."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if not flag.startswith("--") or flag in known:
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return message + (f" ({'; '.join(hints)})" if hints else "")


def refuse(command: str, *problems: str) -> int:
    """Print each problem as ``qwz-qualify COMMAND: error: PROBLEM`` on stderr; exit 2."""
    for problem in problems:
        print(f"qwz-qualify {command}: error: {problem}", file=sys.stderr)
    return exit_codes.REFUSED


# Argument types: each refusal names the value and the rule (argparse prefixes the flag
# and exits 2), never Python's "invalid literal for int()" (qualify/base/values.py's rules).
_non_negative = argparse_type(NON_NEGATIVE)
_positive = argparse_type(POSITIVE)
_percentage = argparse_type(
    Real(lambda value: math.isfinite(value) and value >= 0, "a finite percentage >= 0")
)
_finite = argparse_type(FINITE)
_positive_seconds = argparse_type(POSITIVE_FINITE)
_path = argparse_type(PATH)


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser ([Note: one error style] in qualify/cli_parser.py)."""
    from qwz import __version__

    parser = Parser(prog="qwz-qualify", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"qwz-qualify {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_command(commands)
    _add_matrix_command(commands)
    _add_review_commands(commands)
    _add_bisect_commands(commands)
    _add_pr_review_command(commands)
    return parser


def _add_run_command(commands) -> None:
    """``run``: its output flags, then a flag per run setting (qualify/request/settings.py generates
    them from their declarations in qualify/base/plan.py)."""
    from qwz.qualify.request import settings

    run = commands.add_parser("run", help="qualify reference vs quantized arms; write evidence")
    run.add_argument("--out", type=_path, required=True, help="output directory")
    replacing = run.add_mutually_exclusive_group()
    replacing.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier run in --out: its record and every other file a run writes "
        "there are removed (qualify/evidence/run_dir.py)",
    )
    replacing.add_argument(
        "--keep-previous",
        type=_positive,
        default=None,
        metavar="N",
        help="move an earlier run in --out aside to OUT.1 (OUT.1 to OUT.2, ...) and keep N "
        "of them (default: none; an earlier record is refused without --force)",
    )
    run.add_argument(
        "--allow-one-rank",
        action="store_true",
        help="let --world-size 1 run: one rank sends nothing to quantize, so the gather is "
        "not judged and the run is INCONCLUSIVE at best (a smoke test of one device)",
    )
    settings.add_flags(run, settings.run_settings())


def _add_matrix_command(commands) -> None:
    """``matrix``: a spec of axes, one ``run`` per cell (qualify/matrix/)."""
    matrix = commands.add_parser(
        "matrix", help="run every cell of a TOML spec (resumable); write matrix.md and matrix.json"
    )
    matrix.add_argument("spec", type=_path, help="the spec (qualify/matrix/matrix_spec.py)")
    matrix.add_argument(
        "--out",
        type=_path,
        default=None,
        help="matrix directory (default: none; required unless --list)",
    )
    for flag, what in (
        ("--ledger", "none: no reproduction check"),
        ("--min-speedup", "none: speed not gated"),
        ("--deepspeed-src", "none: the installed DeepSpeed"),
    ):
        matrix.add_argument(
            flag,
            type=_finite if flag == "--min-speedup" else _path,
            default=None,
            help=f"every cell's {flag} (default: {what})",
        )
    matrix.add_argument(
        "--list", action="store_true", help="print every cell's run arguments; run nothing"
    )


RECORD_HELP = "a record.json, or the run directory holding it (run's --out)"


def _add_review_commands(commands) -> None:
    """``report``, ``compare``, ``history`` and ``promote``: commands that read records."""
    _add_report_and_compare(commands)
    _add_history_and_promote(commands)


def _add_report_and_compare(commands) -> None:
    report = commands.add_parser("report", help="print the markdown report of a record")
    report.add_argument("record", type=_path, help=RECORD_HELP)
    report.add_argument(
        "--format",
        choices=("markdown", "junit", "summary"),
        default="markdown",
        help="markdown: the full report; junit: every check as a JUnit test case "
        "(qualify/review/junit.py); summary: the short markdown of a CI job summary",
    )

    compare = commands.add_parser(
        "compare",
        help="regression gate between two records, or two matrix directories (cell by cell)",
    )
    compare.add_argument("baseline", type=_path, help=f"{RECORD_HELP}, or a matrix directory")
    compare.add_argument("candidate", type=_path, help="the same, compared with the baseline")
    compare.add_argument(
        "--memory-growth-pct",
        type=_percentage,
        default=10.0,
        help="a candidate arm's peak memory may grow this many percent over the baseline's "
        "before it is a regression",
    )
    compare.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse (exit 2) a record not signed by the configured key "
        "(QWZ_RECORD_KEY or QWZ_RECORD_KEY_FILE)",
    )
    compare.add_argument(
        "--format",
        choices=("text", "junit", "summary"),
        default="text",
        help="text: one finding a line; junit: the gate as a JUnit test case; summary: "
        "markdown for a CI job summary (the exit status is the same)",
    )


def _add_history_and_promote(commands) -> None:
    history = commands.add_parser("history", help="trend of every record under a directory")
    history.add_argument("directory", type=_path, help="searched for record.json files")
    history.add_argument(
        "--out",
        type=_path,
        default=None,
        help="write history.md and history.png here (default: none, print only)",
    )
    history.add_argument(
        "--format",
        choices=("markdown", "junit"),
        default="markdown",
        help="what to print: the markdown table, or every record as a JUnit test case",
    )

    promote = commands.add_parser(
        "promote",
        help="make a passing record (or matrix directory) the baseline the nightly gate "
        "compares with",
    )
    promote.add_argument("record", type=_path, help=f"{RECORD_HELP}, or a matrix directory")
    promote.add_argument("baseline_dir", type=_path, help="the baseline directory to write")
    promote.add_argument(
        "--force", action="store_true", help="replace a baseline already in BASELINE_DIR"
    )


class _ReviewSets(argparse.Action):
    """A run setting ``review`` sets itself, or one that cannot apply to a review
    (qualify/pr_review/request.py), refused as a flag."""

    def __init__(self, option_strings, dest, why="is the review's to set, not a run option",
                 **kwargs):  # fmt: skip
        self.why = why
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.why}")


def _add_pr_review_command(commands) -> None:
    """``review``: a DeepSpeed pull request against its base (qualify/pr_review/); the run
    options are ``run``'s own flags, generated from the same declarations, or follow ``--``."""
    from qwz.qualify.pr_review import request
    from qwz.qualify.request import settings

    review = commands.add_parser(
        "review",
        help="review a DeepSpeed pull request: its base's reference arm and its head's every "
        "arm, the PR's own tests at its head, one claims table (exit 0 PASS, 1 FAIL, "
        "2 refused, 3 INCONCLUSIVE, 4 HARNESS-ERROR, 5 CANNOT-RUN)",
    )
    review.add_argument("--repo", type=_path, required=True, help="the DeepSpeed repository")
    review.add_argument("--base", required=True, help="the PR's base: a branch, tag or commit")
    review.add_argument("--head", required=True, help="the PR's head (pull/N/head, fetched)")
    review.add_argument("--out", type=_path, required=True, help="the review's directory")
    review.add_argument(
        "--worktree",
        type=_path,
        default=None,
        help="the worktree both refs are checked out in (default: OUT/worktree); one path "
        "for several reviews of a repository builds DeepSpeed's ops once",
    )
    review.add_argument(
        "--restart",
        action="store_true",
        help="discard the runs a previous review left in --out (of this or another request)",
    )
    _add_own_tests_flags(review)
    owned = (*request.REVIEW_SETTINGS, *request.NOT_APPLICABLE)
    run_settings = settings.run_settings()
    offered = {k: v for k, v in run_settings.items() if k not in owned}
    settings.add_flags(review, offered, request.SHOWN_DEFAULTS)
    hidden = {"dest": argparse.SUPPRESS, "help": argparse.SUPPRESS}
    for name in request.REVIEW_SETTINGS:
        review.add_argument(run_settings[name].flag, action=_ReviewSets, **hidden)
    for name, why in request.NOT_APPLICABLE.items():
        flag = run_settings[name].flag
        flags = [flag]
        if isinstance(run_settings[name].rule, Boolean):  # --no-FLAG as well
            flags.append("--no-" + flag.removeprefix("--"))
        review.add_argument(*flags, action=_ReviewSets, why=why, **hidden)
    review.add_argument(
        "run_args",
        nargs="*",
        metavar="-- RUN-ARGUMENTS",
        help="more `qwz-qualify run` arguments for both runs",
    )


def _add_own_tests_flags(review) -> None:
    """The PR's own tests ([Note: the PR's own tests] in qualify/pr_review/own_tests.py)."""
    from qwz.qualify.pr_review import own_tests

    which = review.add_mutually_exclusive_group()
    which.add_argument(
        "--pr-tests",
        nargs="+",
        type=str,
        metavar="PATH",
        default=None,
        help="the PR's own test files, relative to the repository's root, where the diff "
        "cannot tell them (a squashed base) (default: the test files `git diff BASE...HEAD` "
        "adds or changes under tests/)",
    )
    which.add_argument("--no-pr-tests", action="store_true", help="do not run the PR's own tests")
    review.add_argument(
        "--pr-tests-file-timeout",
        type=_positive_seconds,
        default=own_tests.FILE_LIMIT_S,
        metavar="S",
        help="each own test file's time limit: a file past it is a hang of the test it was "
        "running, the PR's FAIL",
    )
    review.add_argument(
        "--pr-tests-timeout",
        type=_positive_seconds,
        default=own_tests.TOTAL_LIMIT_S,
        metavar="S",
        help="the time limit of every own test file together, the head's first: files past "
        "it are not run (this runner's limit, never the PR's FAIL: INCONCLUSIVE)",
    )


def _add_bisect_commands(commands) -> None:
    """``bisect`` and ``bisect-step`` (qwz/qualify/bisect/bisect_command.py for their exit
    codes)."""
    for name, text in (
        (
            "bisect",
            "find the first commit the qualification judges bad (exit 0 found, 2 refused "
            "or nothing to find, 3 skipped commits hide it)",
        ),
        (
            "bisect-step",
            "judge the repository's HEAD, as a `git bisect run` command "
            "(exit 0 good, 1 bad, 125 skip, 128 abort)",
        ),
    ):
        command = commands.add_parser(
            name,
            help=text,
            epilog=exit_codes.epilog(name),
            usage_error_status=(
                exit_codes.REFUSED if name == "bisect" else exit_codes.GIT_BISECT_ABORT
            ),
        )
        command.add_argument(
            "--repo",
            type=_path,
            default=pathlib.Path("."),
            help="the repository under test (qwz's, or DeepSpeed's)",
        )
        command.add_argument("--good", required=True, help="a good commit (the older end)")
        command.add_argument("--bad", required=True, help="a bad commit (the newer end)")
        command.add_argument("--out", type=_path, required=True, help="the bisect's directory")
        _add_bisect_oracle(command)
        command.add_argument(
            "--speed-retries",
            type=_non_negative,
            default=2,
            help="--speed: re-measure an ambiguous commit this often, then skip it",
        )
        command.add_argument(
            "--setup",
            default=None,
            metavar="CMD",
            help="a shell command run in each commit's worktree before it is qualified "
            "(default: none)",
        )
        command.add_argument(
            "run_args",
            nargs="*",
            metavar="-- RUN-ARGUMENTS",
            help="the arguments of `qwz-qualify run` every commit is qualified with",
        )


def _add_bisect_oracle(command: argparse.ArgumentParser) -> None:
    """What a bisect searches for: one of ``--check``, ``--hash``, ``--speed`` (default: the
    checks that failed in the bad head's record)."""
    oracle = command.add_mutually_exclusive_group()
    oracle.add_argument(
        "--check",
        default=None,
        metavar="NAME",
        help="search for this check failing (a family or FAMILY[ARM]; "
        "default: the checks that failed in the bad head's record)",
    )
    oracle.add_argument(
        "--hash",
        action="store_true",
        help="search for the first final hash differing from the good head's",
    )
    oracle.add_argument(
        "--speed",
        action="store_true",
        help="search for the first speed-up interval entirely below the good head's",
    )
