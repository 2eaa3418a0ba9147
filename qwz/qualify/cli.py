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
import os
import pathlib
import sys
import time

from qwz.qualify.base import exit_codes
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.cli_parser import build_parser, refuse
from qwz.qualify.request import preflight, run_request


def cmd_run(args: argparse.Namespace) -> int:
    """``run``: the request resolved once ([Note: a request resolved once] in
    qualify/request/run_request.py) and checked, then the run and its files."""
    from qwz.qualify.evidence import machine, run_dir
    from qwz.qualify.review.run_files import write_interrupted
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
            write_interrupted(interrupted, run)
        raise


@dataclasses.dataclass
class _Run:
    """A run preflight accepted: its request, and what its files are written from
    (review/run_files.py's ``RunUnderWay``)."""

    request: run_request.RunRequest
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
    def world_size(self) -> int:
        return self.request.world_size

    @property
    def out(self) -> pathlib.Path:
        return self.request.out


def _qualify(run: _Run) -> int:
    """The conformance table, the ranks, then the run's files; the exit status."""
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.review.run_files import write_evidence, write_failure
    from qwz.qualify.run.launch import RankFailure

    request = run.request
    run.phase = "running the PR's config rules through the subject's parser"
    preload = _rank_imports(request)
    conformance = _conformance_table(request)
    run.phase = "training the arms"
    try:
        observations = _run_ranks(request, run, preload)
    except RankFailure as failure:
        run.phase = "writing what the failed ranks left"
        return write_failure(failure, run, conformance)
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
    return write_evidence(built, run.out)


def _writes_the_files(request) -> bool:
    """Whether this process writes the run's files: always, but under torchrun rank 0 alone."""
    return not request.under_torchrun or os.environ.get("RANK") == "0"


def _conformance_table(request) -> dict | None:
    """The PR's config rules through the subject's own parser and engine, before any rank
    trains ([Note: conformance run] in qualify/run/conformance_run.py); only where the record is
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


def _run_ranks(request, run, preload: tuple[str, ...]):
    """Every rank's observations on rank 0 (None on the others): this process's rank under
    torchrun (a failure's files written by the rank that claims them, [Note: a crash under
    torchrun]), else the request's local ranks, forked after importing `preload` where they
    can be."""
    from qwz.qualify.review.run_files import write_failure
    from qwz.qualify.run import torchrun
    from qwz.qualify.run.launch import launch
    from qwz.qualify.run.runner import qualify_rank

    if request.under_torchrun:
        return torchrun.run(request, lambda failure: write_failure(failure, run, limit_known=False))
    timeout_s = request.launch.timeout
    return launch(qualify_rank, request.world_size, request.plan, timeout_s=timeout_s,
                  preload=preload)[0]  # fmt: skip


def cmd_matrix(args: argparse.Namespace) -> int:
    from qwz.qualify.matrix import matrix_command as command

    return command.main(args, build_parser())


def cmd_report(args: argparse.Namespace) -> int:
    from qwz.qualify.evidence import record, schema, signing
    from qwz.qualify.review import junit, report, summary
    from qwz.qualify.review.run_files import signature_section

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
        print(signature_section(loaded, key))
    return exit_codes.PASS


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


def cmd_bisect(args: argparse.Namespace) -> int:
    from qwz.qualify.bisect import bisect_command as command
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


def cmd_review(args: argparse.Namespace) -> int:
    from qwz.qualify.pr_review import review_command as command
    from qwz.qualify.run.launch import Interrupted, signals_interrupt

    try:
        with signals_interrupt():  # between the runs too, not only while one runs
            return command.run_review(args, build_parser())
    except Interrupted as interrupted:
        print(f"qwz-qualify review: {interrupted}; every finished run is kept in {args.out}",
              file=sys.stderr)  # fmt: skip
        return interrupted.exit_code


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
