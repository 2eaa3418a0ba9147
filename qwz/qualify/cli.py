"""``qwz-qualify`` / ``python -m qwz.qualify``: run, matrix, report, compare.

``run`` starts local ranks (gloo on CPU, NCCL with enough GPUs; forked where
[Note: forked ranks] in qualify/run/launch.py allows, else spawned) unless it was
started by torchrun (RANK and WORLD_SIZE set), in which case every launched
rank runs it and rank 0 writes the files::

    qwz-qualify run --out runs/cpu                       # 2 local ranks, default workload
    torchrun --nnodes 2 --nproc-per-node 8 -m qwz.qualify run --out runs/gpu \\
        --workload qwen3-0.6b --group-size 64 --group-size 8192

Exit statuses: one meaning per status across every command, [Note: exit statuses] in
qualify/base/exit_codes.py (every ``--help`` prints the table); errors in one style, [Note: one
error style] in qualify/cli_parser.py. ``run`` writes its record and report for PASS, FAIL
and INCONCLUSIVE; ``harness-error.json`` for HARNESS-ERROR, ``timed-out.json`` when its
``--timeout`` ran out, ``interrupted.json`` when SIGINT/SIGTERM stopped it (what ran, what
did not; qualify/evidence/unfinished.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import pathlib
import signal
import sys
import time
from typing import Any

from qwz.qualify.base import exit_codes
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.base.values import (
    FINITE,
    NON_NEGATIVE,
    PATH,
    POSITIVE,
    POSITIVE_FINITE,
    Boolean,
    Real,
)
from qwz.qualify.cli_parser import Parser, refuse
from qwz.qualify.request import preflight, run_request
from qwz.qualify.request.settings import argparse_type

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

    parser = Parser(prog="qwz-qualify", description=__doc__.split("\n")[0])
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
    matrix.add_argument("spec", type=_path, help="the spec (qualify/matrix/spec.py)")
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


def cmd_review(args: argparse.Namespace) -> int:
    from qwz.qualify.pr_review import command
    from qwz.qualify.run.launch import Interrupted, signals_interrupt

    try:
        with signals_interrupt():  # between the runs too, not only while one runs
            return command.run_review(args, build_parser())
    except Interrupted as interrupted:
        print(f"qwz-qualify review: {interrupted}; every finished run is kept in {args.out}",
              file=sys.stderr)  # fmt: skip
        return interrupted.exit_code


def _add_bisect_commands(commands) -> None:
    """``bisect`` and ``bisect-step`` (qwz/qualify/bisect/command.py for their exit codes)."""
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


def cmd_bisect(args: argparse.Namespace) -> int:
    from qwz.qualify.bisect import command
    from qwz.qualify.run.launch import Interrupted, signals_interrupt

    # Whole flags only: the run parser takes no abbreviation ([Note: one error style]).
    for flag in ("--out", "--force", "--keep-previous", "--deepspeed-src"):
        if any(item == flag or item.startswith(flag + "=") for item in args.run_args):
            refuse(args.command, f"{flag} is the bisect's to set, not a run argument")
            return 2 if args.command == "bisect" else command.STEP_ABORT
    try:  # the run arguments are checked before any commit is checked out
        run = build_parser().parse_args(["run", "--out", str(args.out), *args.run_args])
    except SystemExit:  # argparse said why
        return 2 if args.command == "bisect" else command.STEP_ABORT
    subject = run_request.preset_values(run)["subject"]  # given, the preset's or the default
    kind = "check" if args.check else "hash" if args.hash else "speed" if args.speed else "default"
    options = command.Options(
        args.repo,
        args.good,
        args.bad,
        args.out,
        kind,
        args.check,
        args.speed_retries if args.speed else 0,
        args.setup,
        subject,
        list(args.run_args),
    )
    try:
        with signals_interrupt():  # between trials too, not only while one runs
            return (command.run_bisect if args.command == "bisect" else command.run_step)(options)
    except Interrupted as interrupted:  # [Note: stopping a trial] in qualify/bisect/trial.py
        print(f"qwz-qualify {args.command}: {interrupted}; the trial's ranks were stopped and "
              f"every finished attempt is kept in {args.out} (run it again to resume)",
              file=sys.stderr)  # fmt: skip
        return interrupted.exit_code


def _run_torchrun(request, invocation):
    """This rank's part of a run torchrun started; rank 0 gets every rank's observations.

    [Note: a crash under torchrun]
    A rank's own failure ends it through qwz.qualify.base.rank_reports.crash, as with local ranks
    ([Note: failures], qualify/run/runner.py), and torchrun's agent then stops the others;
    no process outlives the ranks to read their reports, as a local launcher does. So the
    rank that fails first to claim the run's record writes it, from crash()'s hook, before it
    exits: it waits up to launch.GRACE_S for every rank's report, picks the rank that failed
    first ([Note: the rank that failed first]) and writes the FAIL record a local run
    would (keeping the arms every rank finished), ignoring torchrun's SIGTERM meanwhile. The
    reports go to ``<out>/rank-reports/<run>`` (one directory per torchrun run and restart,
    so a run never reads an earlier one's); across nodes the writer sees every rank's
    reports only where ``--out`` is a shared directory, and ranks it cannot see are
    "unreported". A rank killed by a signal is named when a peer's collective fails (on
    gloo at once; on NCCL when the aborted collective raises); a run whose ranks all hang
    or die leaves only their reports (torchrun's agent has their exit statuses)."""
    import torch.distributed as dist

    from qwz.qualify.base import rank_reports
    from qwz.qualify.run.launch import torchrun_failure
    from qwz.qualify.run.runner import qualify_rank

    plan, world_size, out = request.plan, request.world_size, request.out
    running = f"{qualify_rank.__module__}.{qualify_rank.__qualname__}"
    reports = _torchrun_reports(out)

    def write_record() -> None:  # crash()'s hook on a rank with peers
        if rank_reports.claim("record"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            failure = torchrun_failure(reports, world_size, running)
            _write_failure(failure, plan, world_size, invocation, out)

    _init_torchrun_group(request.launch.timeout)
    rank_reports.on_crash(write_record)
    try:
        observations = qualify_rank(plan)
    except Exception as error:  # with one rank, crash() re-raised it; or raised before it
        if rank_reports.reported_failure(reports, dist.get_rank()) is None:
            with contextlib.suppress(Exception):
                rank_reports.crash(error, phase="start")  # with peers it exits here
        raise torchrun_failure(reports, world_size, running, grace_s=0) from error
    finally:
        rank_reports.on_crash(None)
        dist.destroy_process_group()
    rank_reports.forget()  # this rank finished: its reports are moot
    with contextlib.suppress(OSError):
        (out / "rank-reports").rmdir()
    return observations


def _torchrun_reports(out: pathlib.Path) -> pathlib.Path:
    """This torchrun run's reports directory ([Note: a crash under torchrun]), set for the
    side channel (qwz.qualify.base.rank_reports) unless ``QWZ_RANK_REPORTS`` names one."""
    from qwz.qualify.base import rank_reports

    if rank_reports.REPORTS_ENV not in os.environ:
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "run")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        reports = out / "rank-reports" / f"{run}-{restart}"
        reports.mkdir(parents=True, exist_ok=True)
        os.environ[rank_reports.REPORTS_ENV] = str(reports)
    return pathlib.Path(os.environ[rank_reports.REPORTS_ENV])


def _init_torchrun_group(timeout_s: float) -> None:
    """The default process group torchrun's environment describes: NCCL on this rank's GPU
    (LOCAL_RANK) where there is one, else gloo."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )


def cmd_run(args: argparse.Namespace) -> int:
    """``run``: the request resolved once ([Note: a request resolved once] in
    qualify/request/run_request.py) and checked, then the run and its files."""
    from qwz.qualify.evidence import machine, run_dir
    from qwz.qualify.run.launch import Interrupted, signals_interrupt

    try:
        request = run_request.resolve(args)
    except run_request.Refused as refused:
        return refuse("run", *refused.problems)
    problems = preflight.problems(request)
    if request.one_arm_chosen:
        print(
            "qwz-qualify run: two arms do not fit on the GPUs with their activations; "
            "holding one arm at a time (--one-arm-at-a-time)",
            file=sys.stderr,
        )
    if problems:
        return refuse("run", *problems)
    _prepare(request)
    invocation = machine.invocation(list(request.argv))
    if request.keep_previous is not None and _writes_the_files(request):  # [Note: results kept]
        for line in run_dir.keep_previous(request.out, request.keep_previous):
            print(f"qwz-qualify run: {line}", file=sys.stderr)
    run = _Run(request, invocation, time.monotonic())
    try:
        with signals_interrupt():  # from here on, a stopped run says how far it got
            return _qualify(run)
    except Interrupted as interrupted:
        if _writes_the_files(request):
            _write_interrupted(interrupted, run)
        raise


@dataclasses.dataclass
class _Run:
    """A run preflight accepted: what its files are written from."""

    request: Any
    invocation: dict
    started_s: float
    """time.monotonic() when the request was accepted (durations)."""
    started_at: float = dataclasses.field(default_factory=time.time)
    """time.time() then (file times)."""
    phase: str = "starting"
    """What it is doing now, for interrupted.json."""

    @property
    def plan(self):
        return self.request.plan

    @property
    def out(self) -> pathlib.Path:
        return self.request.out


def _qualify(run: _Run) -> int:
    """The conformance table, the ranks, then the run's files; the exit status."""
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.run.launch import RankFailure

    request = run.request
    world_size = request.world_size
    run.phase = "running the PR's config rules through the subject's parser"
    preload = _rank_imports(request)
    conformance = _conformance_table(request)
    run.phase = "training the arms"
    try:
        observations = _run_ranks(request, run.invocation, preload)
    except RankFailure as failure:
        run.phase = "writing what the failed ranks left"
        return _write_failure(
            failure, run.plan, world_size, run.invocation, run.out, conformance, run
        )
    if observations is None:  # not rank 0
        return exit_codes.PASS
    run.phase = "judging the observations and writing the record"
    built = evidence.build_record(
        run.plan,
        observations,
        ledger_dir=request.launch.ledger,
        min_speedup=request.launch.min_speedup,
        invocation=run.invocation,
        conformance=conformance,
    )
    return _write_evidence(built, run.out)


def _writes_the_files(request) -> bool:
    """Whether this process writes the run's files: always, but under torchrun rank 0 alone."""
    return not request.under_torchrun or os.environ.get("RANK") == "0"


def _conformance_table(request) -> dict | None:
    """The PR's config rules through the subject's own parser and engine, before any rank
    trains ([Note: conformance run] in qualify/run/conformance.py); only where the record is
    written (under torchrun: rank 0). Where ``QWZ_CONFORMANCE_CACHE`` is set, a table of the
    same code may be reused ([Note: reused conformance tables] in run/conformance_cache.py)."""
    from qwz.qualify.run import conformance_cache

    if not _writes_the_files(request):
        return None
    plan = request.plan
    table, reused = conformance_cache.table(
        plan.subject,
        qwz_gather=plan.qwz_gather,
        deepspeed_src=plan.deepspeed_src,
        cpu_quantizer=plan.cpu_quantizer,
    )
    said = table["error"] or f"{len(table['rows'])} configs in {table['seconds']:.1f} s"
    if reused is not None:
        said += f", reused from {reused} ({conformance_cache.CACHE_ENV})"
    print(f"qwz-qualify: the PR's config rules through the subject's parser: {said}",
          file=sys.stderr)  # fmt: skip
    return table


def _prepare(request) -> None:
    """Before the ranks: say where the kernels fall back ([Note: fused kernels checked before
    a run], qualify/request/kernel_check.py), and import the subject's DeepSpeed here."""
    from qwz.qualify.base.plan import DEEPSPEED_SUBJECTS
    from qwz.qualify.request import kernel_check
    from qwz.qualify.run.subjects import use_deepspeed_source

    plan = request.plan
    if request.eager_fallback:
        print(
            "qwz-qualify: the fused kernels are not usable here (no C compiler?); "
            "the arms use the eager kernels, and the record says so",
            file=sys.stderr,
        )
    kernel_check.cuda_failure(plan, request.world_size, request.under_torchrun)
    if plan.subject in DEEPSPEED_SUBJECTS:
        # Here too: local ranks start from this sys.path (forked ones from the deepspeed
        # imported here), and the failure record's identity is read in this process.
        use_deepspeed_source(plan.deepspeed_src)


def _rank_imports(request) -> tuple[str, ...]:
    """The modules local ranks import, imported here now where they will be forked from this
    process ([Note: forked ranks] in qualify/run/launch.py), so the conformance table's child,
    forked before them, starts from them too; none under torchrun."""
    from qwz.qualify.run.launch import import_for_fork
    from qwz.qualify.run.subjects import rank_imports

    if request.under_torchrun:
        return ()
    preload = rank_imports(request.plan.subject)
    import_for_fork(request.backend, preload)
    return preload


def _run_ranks(request, invocation, preload: tuple[str, ...]):
    """Every rank's observations on rank 0 (None on the others): this process's rank under
    torchrun, else the request's local ranks, forked after importing `preload` where they
    can be."""
    from qwz.qualify.run.launch import launch
    from qwz.qualify.run.runner import qualify_rank

    if request.under_torchrun:
        return _run_torchrun(request, invocation)
    timeout_s = request.launch.timeout
    return launch(qualify_rank, request.world_size, request.plan, timeout_s=timeout_s,
                  preload=preload)[0]  # fmt: skip


def _write_failure(
    failure, plan, world_size: int, invocation, out: pathlib.Path, conformance=None, run=None
) -> int:
    """A rank raised, died or hung ([Note: failures] in qualify/run/runner.py): the evidence
    is a FAIL record naming the rank that failed first, the arm and the step; or no verdict:
    where the harness could not observe the subject ([Note: harness errors]), or where the
    run's own time limit ran out ([Note: unfinished runs])."""
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.evidence import harness_error, run_dir

    print(f"qwz-qualify: the ranks failed: {failure}", file=sys.stderr)
    if failure.cause is None:
        raise failure
    if failure.cause.how == "timeout" and run is not None and failure.limit_s is not None:
        return _write_timed_out(failure, run)
    unjudged = harness_error.unjudged(failure.cause)
    if unjudged is not None:
        verdict, exit_code = unjudged
        content = harness_error.report(failure.cause, plan.subject, invocation, verdict)
        path = harness_error.write(out, content)
        run_dir.remove_stale(out, [harness_error.FILE_NAME])
        print(f"wrote {path}; {harness_error.summary(content)}")
        return exit_code
    built = evidence.build_failure_record(
        plan, world_size, failure.cause, failure.context, failure.results, invocation, conformance
    )
    return _write_evidence(built, out)


def _write_timed_out(failure, run: _Run) -> int:
    """[Note: unfinished runs]: ``timed-out.json``, its own verdict naming the limit; exit 3."""
    from qwz.qualify.evidence import unfinished

    limit_s = failure.limit_s
    ends = [failure.cause, *failure.context]
    progress = unfinished.progress(
        [arm.name for arm in run.plan.arms],
        {rank: list(kept) for rank, kept in failure.results.items()},
        {end.rank: end.where for end in ends},
    )
    seconds = time.monotonic() - run.started_s
    content = unfinished.timed_out(limit_s, progress, seconds, run.invocation)
    _write_unfinished(run.out, unfinished.TIMED_OUT_FILE, content)
    return exit_codes.INCONCLUSIVE


def _write_interrupted(interrupted, run: _Run) -> None:
    """[Note: unfinished runs]: ``interrupted.json``, what ran and what did not; nothing where
    the signal came after this run's record was written (the run is done: it is kept)."""
    from qwz.qualify.evidence import run_dir, unfinished

    record = run.out / run_dir.RECORD
    if record.is_file() and record.stat().st_mtime >= run.started_at:
        return
    finished, where = interrupted.ranks or ({}, {})
    progress = unfinished.progress([arm.name for arm in run.plan.arms], finished, where)
    seconds = time.monotonic() - run.started_s
    content = unfinished.interrupted(
        interrupted.signal_name, run.phase, progress, seconds, run.invocation
    )
    _write_unfinished(run.out, unfinished.INTERRUPTED_FILE, content)


def _write_unfinished(out: pathlib.Path, name: str, content: dict) -> None:
    from qwz.qualify.evidence import run_dir, unfinished

    path = unfinished.write(out, name, content)
    run_dir.remove_stale(out, [name])
    print(f"wrote {path}; {unfinished.summary(content)}")


def _write_evidence(built, out: pathlib.Path) -> int:
    """The plots, the report and the record of a run in `out`; the run's exit code."""
    from qwz.qualify.evidence import run_dir, signing
    from qwz.qualify.review import outputs

    key = signing.configured_key()  # usable: preflight tried it
    if key is not None:
        built = built.model_copy(update={"signature": signing.sign(built.digest, key)})
    # Plots, then the report, then the record, each atomically: a run cut short leaves
    # no record.json, or the previous one, never a partial one (qwz.qualify.base.files); a
    # plot that fails costs neither ([Note: nothing lost after a run], review/outputs.py).
    plots = outputs.write_run_outputs(built, out, key, _signature_section(built, key)).plots
    # An earlier run's files, now moot ([Note: results kept]): its plots that this run
    # did not draw, a harness-error.json or timed-out.json.
    run_dir.remove_stale(out, [run_dir.RECORD, run_dir.REPORT, *plots.values()])
    verdict = built.verdict
    status = verdict.status
    if verdict.failed:
        status += ": " + ", ".join(verdict.failed)
    elif verdict.inconclusive:
        status += ": " + ", ".join(verdict.inconclusive)
    print(f"wrote {out / 'record.json'}, {out / 'report.md'} and {len(plots)} plots; {status}")
    for op in built.subject.substituted_ops:
        print(f"substituted: {op}")
    scheme = outputs.scheme_sentence(built)
    if scheme:
        print(f"scheme: {scheme}")
    return exit_codes.VERDICT_EXITS[verdict.status]


def cmd_matrix(args: argparse.Namespace) -> int:
    from qwz.qualify.matrix import command

    return command.main(args, build_parser())


def cmd_report(args: argparse.Namespace) -> int:
    from qwz.qualify.evidence import record, schema, signing
    from qwz.qualify.review import junit, report, summary

    try:
        key = signing.configured_key()
        loaded = record.load(args.record)
    except (schema.RecordError, signing.SigningKeyError) as error:
        return refuse("report", str(error))
    if args.format == "junit":
        print(junit.record_junit(loaded), end="")
    elif args.format == "summary":
        print(summary.record_summary(loaded), end="")
    else:
        print(report.render_markdown(loaded))
        print(_signature_section(loaded, key))
    return exit_codes.PASS


def _signature_section(built, key) -> str:
    """The markdown a report ends with: signed or unsigned, by which key, verified?"""
    from qwz.qualify.evidence.signing import describe

    return f"\n## Signature\n\n{describe(built.digest, built.signature, key)}\n"


def cmd_compare(args: argparse.Namespace) -> int:
    from qwz.qualify.evidence import signing
    from qwz.qualify.review import compare, junit, matrix, matrix_compare, outputs, summary

    try:
        key = signing.configured_key()
    except signing.SigningKeyError as error:
        return refuse("compare", str(error))
    judge = compare.compare_files
    if matrix.is_matrix_dir(args.baseline) or matrix.is_matrix_dir(args.candidate):
        judge = matrix_compare.compare_matrices  # cell by cell; each pair as below
    result = judge(
        args.baseline,
        args.candidate,
        memory_growth_pct=args.memory_growth_pct,
        require_signature=args.require_signature,
        key=key,
    )
    if result.status != compare.Status.NOT_COMPARABLE and judge is compare.compare_files:
        signatures = []
        for role, path in (("baseline", args.baseline), ("candidate", args.candidate)):
            loaded = compare.load(path)
            described = signing.describe(loaded.digest, loaded.signature, key)
            signatures.append(f"{role} signature: {described}")
        result = dataclasses.replace(result, lines=[*signatures, *result.lines])
    outputs.append_job_summary(summary.comparison_summary(result))
    if args.format == "junit":
        print(junit.comparison_junit(result), end="")
    elif args.format == "summary":
        print(summary.comparison_summary(result), end="")
    elif result.status == compare.Status.NOT_COMPARABLE:  # [Note: one error style]
        said = [line.removeprefix("NOT COMPARABLE: ") for line in result.lines]
        return refuse("compare", *(line for line in said if line != "result: not comparable"))
    else:
        print(result.text())
    return result.status


def cmd_history(args: argparse.Namespace) -> int:
    from qwz.qualify.base.files import writable_directory_problem
    from qwz.qualify.evidence import signing
    from qwz.qualify.review import history, junit, outputs

    if not args.directory.is_dir():
        return refuse("history", f"{args.directory}: not a directory")
    problem = args.out and writable_directory_problem(args.out, "--out")
    try:
        key = signing.configured_key()
    except signing.SigningKeyError as error:
        return refuse("history", *filter(None, [problem, str(error)]))
    if problem:
        return refuse("history", problem)
    nights, problems = history.collect(args.directory)
    plot, drawn = None, None
    if args.out is not None and nights:
        drawn = outputs.draw_into(args.out, lambda staging: history.draw_plot(nights, staging))
        plot = drawn.plots.get("history")
    text = history.render_markdown(nights, problems, key, plot)
    text += drawn.note() if drawn is not None else ""
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "history.md", text)
    outputs.append_job_summary(text)
    print(junit.history_junit(nights, problems) if args.format == "junit" else text, end="")
    return exit_codes.REFUSED if problems or not nights else exit_codes.PASS


def cmd_promote(args: argparse.Namespace) -> int:
    from qwz.qualify.base.files import writable_directory_problem
    from qwz.qualify.evidence import run_dir, schema
    from qwz.qualify.review import history, matrix

    problem = writable_directory_problem(args.baseline_dir, "BASELINE_DIR")
    if problem is None and not args.force and _holds_a_baseline(args.baseline_dir):
        problem = (
            f"{args.baseline_dir}: already holds a baseline; pass --force to replace it "
            "(the nightly's gate compares with it), or choose another directory"
        )
    if problem:
        return refuse("promote", problem)
    try:
        if matrix.is_matrix_dir(args.record):
            promoted_matrix = matrix.promote_matrix(args.record, args.baseline_dir)
            kept = sum(cell.record is not None for cell in promoted_matrix.cells)
            print(f"promoted {kept} cells of {args.record} to {args.baseline_dir}")
            return exit_codes.PASS
        source = run_dir.record_in(args.record)
        promoted = history.promote(source, args.baseline_dir)
    except schema.RecordError as error:
        return refuse("promote", str(error))
    print(
        f"promoted {source} (head {promoted.head.sha[:12]}, {promoted.created_at}) "
        f"to {args.baseline_dir / 'record.json'}"
    )
    return exit_codes.PASS


def _holds_a_baseline(directory: pathlib.Path) -> bool:
    """A promoted record or matrix table is there (``promote`` writes one of them last)."""
    from qwz.qualify.review import matrix

    return (directory / "record.json").exists() or matrix.is_matrix_dir(directory)


HANDLERS = {
    "run": cmd_run,
    "matrix": cmd_matrix,
    "report": cmd_report,
    "compare": cmd_compare,
    "history": cmd_history,
    "promote": cmd_promote,
    "bisect": cmd_bisect,
    "bisect-step": cmd_bisect,
    "review": cmd_review,
}


def main(argv: list[str] | None = None) -> int:
    """Parse, run the command, and turn what escapes it into its exit status
    ([Note: exit statuses]): a signal into 130/143, a closed pipe into a quiet 141, a file
    the command cannot read or write into one line and 2, and anything else -- a bug of the
    harness, never the subject's failure -- into its traceback and 4."""
    from qwz.qualify.run.launch import Interrupted

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # [Note: reproduce]
    try:
        return HANDLERS[args.command](args)
    except Interrupted as interrupted:
        print(f"qwz-qualify {args.command}: {interrupted}; every rank was stopped",
              file=sys.stderr)  # fmt: skip
        return interrupted.exit_code
    except KeyboardInterrupt:
        print(f"qwz-qualify {args.command}: interrupted by SIGINT", file=sys.stderr)
        return exit_codes.INTERRUPTED_SIGINT
    except BrokenPipeError:
        _silence_stdout()
        return exit_codes.OUTPUT_CLOSED
    except OSError as error:
        if error.filename is None:  # not about a file: the harness's own failure
            return _harness_bug(args.command)
        return refuse(args.command, _describe_os_error(error))
    except Exception:
        return _harness_bug(args.command)


def _silence_stdout() -> None:
    """The reader of stdout went away (``| head``): nothing more is written there, not even
    the interpreter's last flush (which would print its own BrokenPipeError)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _describe_os_error(error: OSError) -> str:
    """``PATH: what went wrong`` (``[Errno 30] Read-only file system: 'x'`` -> ``x: read-only
    file system``)."""
    path = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
    reason = (error.strerror or type(error).__name__).lower()
    return f"{path}: {reason}"


def _harness_bug(command: str) -> int:
    """An exception the command did not expect: its traceback for whoever fixes it, and the
    one line that says it is the harness's, never the subject's ([Note: exit statuses])."""
    import traceback

    traceback.print_exc()
    print(
        f"qwz-qualify {command}: HARNESS-ERROR: a bug in qwz-qualify (the traceback above), "
        "not a verdict on the subject",
        file=sys.stderr,
    )
    return exit_codes.HARNESS_ERROR


if __name__ == "__main__":
    sys.exit(main())
