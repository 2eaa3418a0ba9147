"""``qwz-qualify`` / ``python -m qwz.qualify``: run, report, compare.

``run`` spawns local ranks (gloo on CPU, NCCL with enough GPUs) unless it was
started by torchrun (RANK and WORLD_SIZE set), in which case every launched
rank runs it and rank 0 writes the files::

    qwz-qualify run --out runs/cpu                       # 2 local ranks, default workload
    torchrun --nnodes 2 --nproc-per-node 8 -m qwz.qualify run --out runs/gpu \\
        --workload qwen3-0.6b --group-size 64 --group-size 8192

Exit codes: ``run`` 0 PASS, 1 FAIL (a check failed, an arm diverged or a rank
crashed), 3 INCONCLUSIVE (the reference did not learn, so learning could not be
judged) -- the record and report are written in every case; ``compare`` 0 no
regression, 1 regression, 2 not comparable or invalid; 2 for usage errors
everywhere.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys

from qwz.config import validate_group_size
from qwz.quant import compile_available

EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def _group_size(text: str) -> int:
    try:
        return validate_group_size(int(text), stage=2, key="--group-size")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be >= 0")
    return value


def _percentage(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be a percentage >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    from qwz.qualify.subjects import SUBJECTS
    from qwz.qualify.workloads import WORKLOAD_NAMES

    parser = argparse.ArgumentParser(prog="qwz-qualify", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="qualify reference vs quantized arms; write evidence")
    run.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    run.add_argument("--world-size", type=_positive, default=None, help="local ranks (default 2)")
    run.add_argument("--steps", type=_positive, default=20, help="lockstep steps (default 20)")
    run.add_argument("--stage", type=int, choices=(1, 2), default=2)
    run.add_argument(
        "--group-size",
        type=_group_size,
        action="append",
        dest="group_sizes",
        help="candidate group size; repeat for several arms (default 64)",
    )
    run.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    run.add_argument("--workload", choices=WORKLOAD_NAMES, default="qwen3-tiny")
    run.add_argument("--subject", choices=SUBJECTS, default="qwz")
    run.add_argument("--blocks", type=_positive, default=4, help="order-balanced speed blocks")
    run.add_argument("--block-steps", type=_positive, default=5, help="timed steps per arm")
    run.add_argument(
        "--warmup-steps", type=_non_negative, default=2, help="untimed steps per arm/block"
    )
    run.add_argument("--ledger", type=pathlib.Path, default=None, help="hash ledger directory")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)"
    )
    run.add_argument(
        "--eval-every",
        type=_positive,
        default=5,
        help="held-out evaluation every N steps (and at step 0 and the last step)",
    )
    run.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip the calibration arm (the learning margin is then its floor alone)",
    )
    run.add_argument(
        "--one-arm-at-a-time",
        action="store_true",
        help="hold one arm in memory even while timing (rebuilt during warm-up at each switch)",
    )
    run.add_argument(
        "--bucket-size",
        type=_positive,
        default=500_000_000,
        help="allgather_bucket_size and reduce_bucket_size, in elements",
    )
    run.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fuse the quantize/dequantize kernels with torch.compile (qwz subject)",
    )
    run.add_argument(
        "--min-speedup",
        type=float,
        default=None,
        help="fail unless the speed-up interval's lower end reaches this",
    )
    run.add_argument(
        "--no-integration",
        action="store_true",
        help="deepspeed subject: leave DeepSpeed stock even for candidate arms",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds: the whole run (local ranks) or any one collective (torchrun)",
    )

    report = commands.add_parser("report", help="print the markdown report of a record")
    report.add_argument("record", type=pathlib.Path)

    compare = commands.add_parser("compare", help="regression gate between two records")
    compare.add_argument("baseline", type=pathlib.Path)
    compare.add_argument("candidate", type=pathlib.Path)
    compare.add_argument("--memory-growth-pct", type=_percentage, default=10.0)
    return parser


def _plan(args: argparse.Namespace):
    from qwz.qualify.runner import RunPlan
    from qwz.qualify.workloads import get_workload

    return RunPlan(
        workload=get_workload(args.workload),
        subject=args.subject,
        stage=args.stage,
        dtype=args.dtype,
        group_sizes=tuple(args.group_sizes or (64,)),
        steps=args.steps,
        blocks=args.blocks,
        block_steps=args.block_steps,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        lr=args.lr,
        weight_decay=args.weight_decay,
        eval_every=args.eval_every,
        calibrate=not args.no_calibration,
        one_arm_resident=args.one_arm_at_a_time,
        allgather_bucket_size=args.bucket_size,
        compile_kernels=args.compile,
        integration_enabled=not args.no_integration,
    )


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_torchrun(plan, timeout_s: float):
    import torch
    import torch.distributed as dist

    from qwz.qualify.runner import qualify_rank

    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    try:
        return qualify_rank(plan)
    finally:
        dist.destroy_process_group()


def cmd_run(args: argparse.Namespace) -> int:
    from qwz.launch import RankFailure, launch
    from qwz.qualify import evidence, record, report
    from qwz.qualify.runner import qualify_rank

    if args.no_integration and args.subject != "deepspeed":
        print("--no-integration applies to --subject deepspeed only", file=sys.stderr)
        return 2
    if args.compile and not compile_available():
        print(
            "qwz-qualify: torch.compile is not usable here (no C++ compiler?); "
            "the arms use the eager kernels, and the record says so",
            file=sys.stderr,
        )
        args.compile = False
    if args.one_arm_at_a_time and args.warmup_steps < 1:
        print(
            "--one-arm-at-a-time needs --warmup-steps >= 1 (arms are rebuilt then)", file=sys.stderr
        )
        return 2
    plan = _plan(args)
    world_size = args.world_size or 2
    try:
        if _under_torchrun():
            launched = int(os.environ["WORLD_SIZE"])
            if args.world_size not in (None, launched):
                print(
                    f"--world-size {args.world_size} contradicts torchrun's {launched}",
                    file=sys.stderr,
                )
                return 2
            world_size = launched
            observations = _run_torchrun(plan, args.timeout)
        else:
            observations = launch(qualify_rank, world_size, plan, timeout_s=args.timeout)[0]
    except RankFailure as failure:
        # A rank died or hung: the evidence is a FAIL record naming the rank and the error.
        print(f"qwz-qualify: the ranks failed: {failure}", file=sys.stderr)
        if _under_torchrun() and int(os.environ.get("RANK", "0")) != 0:
            return 1
        observations = None
        built = evidence.build_failure_record(plan, world_size, str(failure))
    else:
        if observations is None:  # not rank 0
            return 0
        built = evidence.build_record(
            plan, observations, ledger_dir=args.ledger, min_speedup=args.min_speedup
        )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    record.save(built, out / "record.json")
    plots = report.write_plots(built, out)
    (out / "report.md").write_text(report.render_markdown(built, plots))
    verdict = built.verdict
    status = verdict.status
    if verdict.failed:
        status += ": " + ", ".join(verdict.failed)
    elif verdict.inconclusive:
        status += ": " + ", ".join(verdict.inconclusive)
    print(f"wrote {out / 'record.json'}, {out / 'report.md'} and {len(plots)} plots; {status}")
    return EXIT_CODES[verdict.status]


def cmd_report(args: argparse.Namespace) -> int:
    from qwz.qualify import record, report

    try:
        loaded = record.load(args.record)
    except record.RecordError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report.render_markdown(loaded))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from qwz.qualify import compare

    result = compare.compare_files(
        args.baseline, args.candidate, memory_growth_pct=args.memory_growth_pct
    )
    for line in result.lines:
        print(line)
    return result.status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"run": cmd_run, "report": cmd_report, "compare": cmd_compare}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
