"""``qwz-qualify`` / ``python -m qwz.qualify``: run, matrix, report, compare.

``run`` starts local ranks (gloo on CPU, NCCL with enough GPUs; forked where
[Note: forked ranks] in qualify/run/launch.py allows, else spawned) unless it was
started by torchrun (RANK and WORLD_SIZE set), in which case every launched
rank runs it and rank 0 writes the files::

    qwz-qualify run --out runs/cpu                       # 2 local ranks, default workload
    torchrun --nnodes 2 --nproc-per-node 8 -m qwz.qualify run --out runs/gpu \\
        --workload qwen3-0.6b --group-size 64 --group-size 8192

Exit codes: ``run`` 0 PASS, 1 FAIL (a check failed, an arm diverged or a rank
crashed), 3 INCONCLUSIVE (the reference did not learn, so learning could not be
judged; or one rank, where nothing was quantized or sent) -- the record and report
are written in every one of these cases; 4 HARNESS-ERROR (the harness could not observe
the subject, e.g. its seam met a DeepSpeed optimizer without what it reads: no verdict,
``harness-error.json`` names what the harness needed and the subject's version and commit,
qualify/evidence/harness_error.py); 2 when the request is refused before any
rank starts (a bad flag value, an unusable ``--out`` or ``--ledger``, an existing
record without ``--force``, a missing optional package, a bucket size needing too
many collectives, more ranks or memory than the machine has, a group size larger
than a rank's shard, a DeepSpeed the seam cannot read), 130/143 when SIGINT/SIGTERM stopped
it (every rank is killed, nothing is written); ``report`` 0, or 2 for a record that cannot
be trusted; ``compare`` 0 no regression, 1 regression, 2 not comparable or invalid;
``history`` 0, or 2 when a record under the directory cannot be loaded (it is listed);
``promote`` 0, or 2 for a record that cannot be trusted or did not pass; ``matrix`` 0 every
cell that ran passed, 1 a cell FAILed or crashed, 4 a HARNESS-ERROR cell (and none FAILed
or crashed), 3 INCONCLUSIVE cells (or no verdict at all), 2 a refused spec or ``--out``,
130/143 stopped (qualify/matrix/command.py); ``review`` the worst of its claims and runs: 0 PASS,
1 FAIL, 3 INCONCLUSIVE, 4 HARNESS-ERROR, 2 refused, 130/143 stopped (qualify/pr_review/command.py);
2 for usage errors everywhere.
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

from qwz.kernels import fused_available
from qwz.qualify import preflight
from qwz.qualify.files import atomic_write_text
from qwz.qualify.settings import argparse_type
from qwz.qualify.values import FINITE, NON_NEGATIVE, PATH, POSITIVE_FINITE, Boolean, Real

EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}

# Argument types: each refusal names the value and the rule (argparse prefixes the flag
# and exits 2), never Python's "invalid literal for int()" (qualify/values.py's rules).
_non_negative = argparse_type(NON_NEGATIVE)
_percentage = argparse_type(
    Real(lambda value: math.isfinite(value) and value >= 0, "a finite percentage >= 0")
)
_finite = argparse_type(FINITE)
_positive_seconds = argparse_type(POSITIVE_FINITE)
_path = argparse_type(PATH)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every default; where the default is None its help says what that means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwz-qualify", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run_command(commands)
    _add_matrix_command(commands)
    _add_review_commands(commands)
    _add_bisect_commands(commands)
    _add_pr_review_command(commands)
    return parser


def _add_run_command(commands) -> None:
    """``run``: its output flags, then a flag per run setting (qualify/settings.py generates
    them from their declarations in qualify/plan.py)."""
    from qwz.qualify import settings

    run = commands.add_parser(
        "run",
        help="qualify reference vs quantized arms; write evidence",
        formatter_class=_DefaultsFormatter,
        epilog="exit status: 0 PASS, 1 FAIL, 2 refused before any rank starts, "
        "3 INCONCLUSIVE, 4 HARNESS-ERROR (the harness could not observe the subject: no "
        "verdict; harness-error.json in --out names what it needed and the subject's "
        "version and commit), 130/143 stopped by SIGINT/SIGTERM",
    )
    run.add_argument("--out", type=_path, required=True, help="output directory")
    run.add_argument("--force", action="store_true", help="overwrite a record already in --out")
    settings.add_flags(run, settings.run_settings())


def _add_matrix_command(commands) -> None:
    """``matrix``: a spec of axes, one ``run`` per cell (qualify/matrix/)."""
    matrix = commands.add_parser(
        "matrix",
        help="run every cell of a TOML spec (resumable); write matrix.md and matrix.json",
        formatter_class=_DefaultsFormatter,
    )
    matrix.add_argument("spec", type=_path, help="the spec (qualify/matrix/spec.py)")
    matrix.add_argument(
        "--out", type=_path, default=None, help="matrix directory (required unless --list)"
    )
    matrix.add_argument("--ledger", type=_path, default=None, help="every cell's --ledger")
    matrix.add_argument(
        "--min-speedup", type=_finite, default=None, help="every cell's --min-speedup"
    )
    matrix.add_argument(
        "--deepspeed-src", type=_path, default=None, help="every cell's --deepspeed-src"
    )
    matrix.add_argument(
        "--list", action="store_true", help="print every cell's run arguments; run nothing"
    )


def _add_review_commands(commands) -> None:
    """``report``, ``compare``, ``history`` and ``promote``: commands that read records."""
    report = commands.add_parser("report", help="print the markdown report of a record")
    report.add_argument("record", type=pathlib.Path)
    report.add_argument(
        "--format",
        choices=("markdown", "junit", "summary"),
        default="markdown",
        help="markdown: the full report; junit: every check as a JUnit test case "
        "(qualify/review/junit.py); summary: the short markdown of a CI job summary "
        "(default: markdown)",
    )

    compare = commands.add_parser(
        "compare",
        help="regression gate between two records, or two matrix directories (cell by cell)",
    )
    compare.add_argument("baseline", type=pathlib.Path)
    compare.add_argument("candidate", type=pathlib.Path)
    compare.add_argument("--memory-growth-pct", type=_percentage, default=10.0)
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
        "markdown for a CI job summary (default: text; the exit status is the same)",
    )

    history = commands.add_parser("history", help="trend of every record under a directory")
    history.add_argument("directory", type=_path)
    history.add_argument(
        "--out", type=_path, default=None, help="write history.md and history.png here"
    )
    history.add_argument(
        "--format",
        choices=("markdown", "junit"),
        default="markdown",
        help="what to print: the markdown table, or every record as a JUnit test case "
        "(default: markdown)",
    )

    promote = commands.add_parser(
        "promote",
        help="make a passing record (or matrix directory) the baseline the nightly gate "
        "compares with",
    )
    promote.add_argument("record", type=_path)
    promote.add_argument("baseline_dir", type=_path)


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
    from qwz.qualify import settings
    from qwz.qualify.pr_review import request

    review = commands.add_parser(
        "review",
        help="review a DeepSpeed pull request: its base's reference arm and its head's every "
        "arm, the PR's own tests at its head, one claims table (exit 0 PASS, 1 FAIL, "
        "2 refused, 3 INCONCLUSIVE, 4 HARNESS-ERROR)",
        formatter_class=_DefaultsFormatter,
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
            "find the first commit the qualification judges bad (exit 0 found, "
            "1 nothing to find, 2 refused, 3 skipped commits hide it)",
        ),
        (
            "bisect-step",
            "judge the repository's HEAD, as a `git bisect run` command "
            "(exit 0 good, 1 bad, 125 skip, 128 abort)",
        ),
    ):
        command = commands.add_parser(name, help=text, formatter_class=_DefaultsFormatter)
        command.add_argument(
            "--repo",
            type=_path,
            default=pathlib.Path("."),
            help="the repository under test (qwz's, or DeepSpeed's)",
        )
        command.add_argument("--good", required=True, help="a good commit (the older end)")
        command.add_argument("--bad", required=True, help="a bad commit (the newer end)")
        command.add_argument("--out", type=_path, required=True, help="the bisect's directory")
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
            help="a shell command run in each commit's worktree before it is qualified",
        )
        command.add_argument(
            "run_args",
            nargs="*",
            metavar="-- RUN-ARGUMENTS",
            help="the arguments of `qwz-qualify run` every commit is qualified with",
        )


def cmd_bisect(args: argparse.Namespace) -> int:
    from qwz.qualify.bisect import command
    from qwz.qualify.run.launch import Interrupted, signals_interrupt

    for flag in ("--out", "--force", "--deepspeed-src"):
        if any(item == flag or item.startswith(flag + "=") for item in args.run_args):
            print(
                f"qwz-qualify {args.command}: error: {flag} is the bisect's to set, not a run "
                "argument",
                file=sys.stderr,
            )
            return 2 if args.command == "bisect" else command.STEP_ABORT
    try:  # the run arguments are checked before any commit is checked out
        run = build_parser().parse_args(["run", "--out", str(args.out), *args.run_args])
    except SystemExit:  # argparse said why
        return 2 if args.command == "bisect" else command.STEP_ABORT
    preflight.apply_preset(run)  # the subject may come from the preset or the declared default
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
        run.subject,
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


def _run_torchrun(plan, world_size: int, args: argparse.Namespace, invocation):
    """This rank's part of a run torchrun started; rank 0 gets every rank's observations.

    [Note: a crash under torchrun]
    A rank's own failure ends it through qwz.qualify.rank_reports.crash, as with local ranks
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

    from qwz.qualify import rank_reports
    from qwz.qualify.run.launch import torchrun_failure
    from qwz.qualify.run.runner import qualify_rank

    running = f"{qualify_rank.__module__}.{qualify_rank.__qualname__}"
    reports = _torchrun_reports(args.out)

    def write_record() -> None:  # crash()'s hook on a rank with peers
        if rank_reports.claim("record"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            failure = torchrun_failure(reports, world_size, running)
            _write_failure(failure, plan, world_size, invocation, args.out)

    _init_torchrun_group(args.timeout)
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
        (args.out / "rank-reports").rmdir()
    return observations


def _torchrun_reports(out: pathlib.Path) -> pathlib.Path:
    """This torchrun run's reports directory ([Note: a crash under torchrun]), set for the
    side channel (qwz.qualify.rank_reports) unless ``QWZ_RANK_REPORTS`` names one."""
    from qwz.qualify import rank_reports

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
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.evidence import machine
    from qwz.qualify.run.launch import RankFailure

    problems = preflight.check_run_request(args)
    if problems:
        for problem in problems:
            print(f"qwz-qualify run: error: {problem}", file=sys.stderr)
        return 2
    plan = _plan_to_run(args)
    world_size = preflight.run_world_size(args)
    invocation = machine.invocation(getattr(args, "argv", sys.argv[1:]))
    preload = _rank_imports(plan, world_size)
    conformance = _conformance_table(plan)
    try:
        observations = _run_ranks(plan, world_size, args, invocation, preload)
    except RankFailure as failure:
        return _write_failure(failure, plan, world_size, invocation, args.out, conformance)
    if observations is None:  # not rank 0
        return 0
    built = evidence.build_record(
        plan,
        observations,
        ledger_dir=args.ledger,
        min_speedup=args.min_speedup,
        invocation=invocation,
        conformance=conformance,
    )
    return _write_evidence(built, args.out)


def _conformance_table(plan) -> dict | None:
    """The PR's config rules through the subject's own parser and engine, before any rank
    trains ([Note: conformance run] in qualify/run/conformance.py); only where the record is
    written (under torchrun: rank 0). Where ``QWZ_CONFORMANCE_CACHE`` is set, a table of the
    same code may be reused ([Note: reused conformance tables] in run/conformance_cache.py)."""
    from qwz.qualify.run import conformance_cache

    if preflight.under_torchrun() and os.environ.get("RANK") != "0":
        return None
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


def _plan_to_run(args: argparse.Namespace):
    """The plan of a request preflight accepted, with the kernels this machine can run
    ([Note: fused kernels checked before a run], qualify/kernel_check.py)."""
    from qwz.qualify import kernel_check
    from qwz.qualify.plan import DEEPSPEED_SUBJECTS
    from qwz.qualify.run.subjects import use_deepspeed_source

    if args.kernels == "fused" and not fused_available():
        print(
            "qwz-qualify: the fused kernels are not usable here (no C compiler?); "
            "the arms use the eager kernels, and the record says so",
            file=sys.stderr,
        )
        args.kernels = "eager"
    plan = preflight.plan_of(args)
    kernel_check.cuda_failure(plan, preflight.run_world_size(args), preflight.under_torchrun())
    if args.subject in DEEPSPEED_SUBJECTS:
        # Here too: local ranks start from this sys.path (forked ones from the deepspeed
        # imported here), and the failure record's identity is read in this process.
        use_deepspeed_source(plan.deepspeed_src)
    return plan


def _rank_imports(plan, world_size: int) -> tuple[str, ...]:
    """The modules local ranks import, imported here now where they will be forked from this
    process ([Note: forked ranks] in qualify/run/launch.py), so the conformance table's child,
    forked before them, starts from them too; none under torchrun."""
    from qwz.qualify.run.launch import import_for_fork, pick_backend
    from qwz.qualify.run.subjects import rank_imports

    if preflight.under_torchrun():
        return ()
    preload = rank_imports(plan.subject)
    import_for_fork(pick_backend(world_size), preload)
    return preload


def _run_ranks(
    plan, world_size: int, args: argparse.Namespace, invocation, preload: tuple[str, ...]
):
    """Every rank's observations on rank 0 (None on the others): this process's rank under
    torchrun, else `world_size` local ranks, forked after importing `preload` where they
    can be."""
    from qwz.qualify.run.launch import launch
    from qwz.qualify.run.runner import qualify_rank

    if preflight.under_torchrun():
        return _run_torchrun(plan, world_size, args, invocation)
    return launch(qualify_rank, world_size, plan, timeout_s=args.timeout, preload=preload)[0]


def _write_failure(
    failure, plan, world_size: int, invocation, out: pathlib.Path, conformance=None
) -> int:
    """A rank raised, died or hung ([Note: failures] in qualify/run/runner.py): the evidence
    is a FAIL record naming the rank that failed first, the arm and the step; or, where the
    harness could not observe the subject, no verdict ([Note: harness errors])."""
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.evidence import harness_error

    print(f"qwz-qualify: the ranks failed: {failure}", file=sys.stderr)
    if failure.cause is None:
        raise failure
    unjudged = harness_error.unjudged(failure.cause)
    if unjudged is not None:
        verdict, exit_code = unjudged
        content = harness_error.report(failure.cause, plan.subject, invocation, verdict)
        path = harness_error.write(out, content)
        print(f"wrote {path}; {harness_error.summary(content)}")
        return exit_code
    built = evidence.build_failure_record(
        plan, world_size, failure.cause, failure.context, failure.results, invocation, conformance
    )
    return _write_evidence(built, out)


def _write_evidence(built, out: pathlib.Path) -> int:
    """The plots, the report and the record of a run in `out`; the run's exit code."""
    from qwz.qualify.evidence import harness_error, signing
    from qwz.qualify.review import outputs

    key = signing.configured_key()  # usable: check_run_request tried it
    if key is not None:
        built = built.model_copy(update={"signature": signing.sign(built.digest, key)})
    # Plots, then the report, then the record, each atomically: a run cut short leaves
    # no record.json, or the previous one, never a partial one (qwz.qualify.files); a
    # plot that fails costs neither ([Note: nothing lost after a run], review/outputs.py).
    plots = outputs.write_run_outputs(built, out, key, _signature_section(built, key)).plots
    (out / harness_error.FILE_NAME).unlink(missing_ok=True)  # an earlier run's, now moot
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
    return EXIT_CODES[verdict.status]


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
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.format == "junit":
        print(junit.record_junit(loaded), end="")
    elif args.format == "summary":
        print(summary.record_summary(loaded), end="")
    else:
        print(report.render_markdown(loaded))
        print(_signature_section(loaded, key))
    return 0


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
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    else:
        print(result.text())
    return result.status


def cmd_history(args: argparse.Namespace) -> int:
    from qwz.qualify.evidence import signing
    from qwz.qualify.review import history, junit, outputs

    if not args.directory.is_dir():
        print(f"error: {args.directory}: not a directory", file=sys.stderr)
        return 2
    try:
        key = signing.configured_key()
    except signing.SigningKeyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    return 2 if problems or not nights else 0


def cmd_promote(args: argparse.Namespace) -> int:
    from qwz.qualify.evidence import schema
    from qwz.qualify.review import history, matrix

    try:
        if matrix.is_matrix_dir(args.record):
            promoted_matrix = matrix.promote_matrix(args.record, args.baseline_dir)
            kept = sum(cell.record is not None for cell in promoted_matrix.cells)
            print(f"promoted {kept} cells of {args.record} to {args.baseline_dir}")
            return 0
        promoted = history.promote(args.record, args.baseline_dir)
    except schema.RecordError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"promoted {args.record} (head {promoted.head.sha[:12]}, {promoted.created_at}) "
        f"to {args.baseline_dir / 'record.json'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    from qwz.qualify.run.launch import Interrupted

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # [Note: reproduce]
    handlers = {
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
    try:
        return handlers[args.command](args)
    except Interrupted as interrupted:
        print(
            f"qwz-qualify: {interrupted}; every rank was stopped and no record was written",
            file=sys.stderr,
        )
        return interrupted.exit_code


if __name__ == "__main__":
    sys.exit(main())
