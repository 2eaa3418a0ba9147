"""Pre-flight: everything that can be known wrong about a ``run`` before the first rank
starts -- the subject's flags, repeated arms, a world size that cannot judge the gather,
``--out`` (an earlier run there, [Note: results kept] in evidence/run_dir.py), the ledger,
the signing key, group sizes against the shards, the optional packages and the bucket size
(requirements.py), local cores and host memory, GPU memory (gpu_memory.py), a ``--timeout``
shorter than the run can take (time_floor.py) -- so a bad request costs nothing (exit 2),
never a finished run's evidence; and the plan the arguments ask for.
"""

from __future__ import annotations

import argparse
import os
import sys

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.base.presets import DEFAULT, PRESETS, Preset
from qwz.qualify.request import settings

RANKS_PER_CORE = 4
"""Local ranks allowed per CPU core: beyond this a run only thrashes (gloo ranks spin)."""
RANK_OVERHEAD_BYTES = 400 * 2**20
"""Host memory of one idle rank: the interpreter, torch and its allocator."""
BYTES_PER_PARAMETER = 20
"""Host memory per parameter per CPU rank, conservatively: working copy and gradient
(fp32, unsharded), fp32 master and two Adam moments (counted unsharded)."""


def check_run_request(args: argparse.Namespace) -> list[str]:
    """Every reason ``run`` would fail after training or cannot be served; one line each.

    Called before any rank starts, so a bad ``--out``, a corrupt ledger or an impossible
    resource request costs nothing (exit 2), never a finished run's evidence."""
    from qwz.qualify.request import requirements

    apply_preset(args)
    wanted = requirements.needed(
        workload=args.workload,
        subject=args.subject,
        blocks=args.blocks,
        learning_rule=args.learning_rule,
    )
    problems = requirements.missing_packages(wanted)
    if problems:  # [Note: optional dependencies]: what follows may import them
        return problems
    problems = apply_ds_config(args)
    if problems:  # what follows reads the settings the file holds
        return problems
    problems += _repeated_values(args)
    problems += _one_rank_problems(args)
    if not args.qwz_gather and args.subject != "deepspeed":
        problems.append("--no-qwz-gather applies to --subject deepspeed only")
    if args.arm_set == "reference" and args.min_speedup is not None:
        problems.append(
            "--min-speedup gates the candidates' speed-up: --arm-set reference trains none"
        )
    if args.one_arm_at_a_time and args.warmup_steps < 1:
        problems.append("--one-arm-at-a-time needs --warmup-steps >= 1 (arms are rebuilt then)")
    if under_torchrun() and "world_size" in args.given:
        launched = int(os.environ["WORLD_SIZE"])
        if args.world_size != launched:
            problems.append(f"--world-size {args.world_size} contradicts torchrun's {launched}")
    problems += _deepspeed_problems(args)
    problems += _qwz_config_problems(args)
    problems += _output_problems(args)
    world_size = run_world_size(args)
    from qwz.qualify.run.workloads import get_workload

    refusals = get_workload(args.workload).refusals(args.subject, world_size)
    if refusals:  # what follows would build the model, which these refuse
        return problems + refusals
    numel = _workload_numel(args.workload, args.seed)
    largest_shard = -(-numel // world_size)
    largest_group = -(-largest_shard // 8) * 8
    for group_size in args.group_sizes or ():
        if group_size > largest_group:
            problems.append(
                f"--group-size {group_size}: larger than a rank's whole shard of the "
                f"{args.workload} model ({numel:,} parameters / {world_size} ranks = "
                f"{largest_shard:,}); at most {largest_group:,}"
            )
    problems += requirements.bucket_size_problems(numel, world_size, args.allgather_bucket_size)
    if not under_torchrun():
        problems += _local_resource_problems(world_size, numel)
        problems += _timeout_problems(args, world_size)
    problems += _gpu_memory_problems(args, world_size, numel)
    return problems


def _repeated_values(args: argparse.Namespace) -> list[str]:
    """A value given twice to a repeated flag (``--group-size 64 --group-size 64``): each is
    one arm, and two arms of one name cannot be recorded (the matrix spec refuses it too)."""
    problems = []
    for name, setting in settings.run_settings().items():
        values = getattr(args, name, None) or ()
        if not setting.declaration.repeated or name not in args.given:
            continue
        repeated = sorted({value for value in values if list(values).count(value) > 1})
        for value in repeated:
            problems.append(
                f"{setting.flag} {value} is given {list(values).count(value)} times: each value "
                "is one arm; give it once"
            )
    return problems


def _one_rank_problems(args: argparse.Namespace) -> list[str]:
    """One rank sends nothing to quantize: the run could only end INCONCLUSIVE ([Note: one
    rank] in qualify/evidence/checks.py), known now. ``--allow-one-rank`` runs it anyway (a
    smoke test of the harness on one device)."""
    if run_world_size(args) != 1 or getattr(args, "allow_one_rank", False):
        return []
    where = "torchrun's world is 1" if under_torchrun() else "--world-size 1"
    return [
        f"{where}: one rank sends nothing to quantize, so the gather cannot be judged (the run "
        "would end INCONCLUSIVE); use 2 or more ranks, or --allow-one-rank for a smoke test"
    ]


def _timeout_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    """[Note: the time floor] (qualify/request/time_floor.py): local ranks only."""
    from qwz.qualify.base.plan import ArmSpec
    from qwz.qualify.request.time_floor import time_floor, timeout_problem
    from qwz.qualify.run.launch import pick_backend

    arms: list[ArmSpec] = plan_of(args).arms
    floor = time_floor(
        workload=args.workload,
        arms=len(arms),
        timed_candidates=sum(arm.timed for arm in arms),
        steps=args.steps,
        blocks=args.blocks,
        warmup_steps=args.warmup_steps,
        block_steps=args.block_steps,
        on_cpu=pick_backend(world_size) == "gloo",
    )
    problem = timeout_problem(args.timeout, floor, args.workload)
    return [problem] if problem else []


def _output_problems(args: argparse.Namespace) -> list[str]:
    """``--out``, the ledger and the signing key: what the run writes and signs with."""
    from qwz.qualify.base.files import writable_directory_problem
    from qwz.qualify.evidence import ledger, run_dir, signing

    problems = []
    out_problem = writable_directory_problem(args.out, "--out")
    keep = getattr(args, "keep_previous", None)
    if out_problem:
        problems.append(out_problem)
    elif keep is not None and under_torchrun():  # every rank starts writing into --out
        problems.append("--keep-previous: not under torchrun; give each run its own --out")
    elif keep is not None:
        problems += filter(None, [run_dir.keep_previous_problem(args.out, keep)])
    elif run_dir.holds_a_run(args.out) and not args.force:  # [Note: results kept]
        found = [name for name in run_dir.RUN_FILES if (args.out / name).exists()]
        problems.append(
            f"--out {args.out}: already holds an earlier run ({', '.join(found)}); pass "
            "--force to replace it, --keep-previous N to move it aside, or choose another "
            "directory"
        )
    if args.ledger is not None:
        problems += ledger.validate_directory(args.ledger)
    try:
        signing.configured_key()
    except signing.SigningKeyError as error:
        problems.append(str(error))
    return problems


def _gpu_memory_problems(args: argparse.Namespace, world_size: int, numel: int) -> list[str]:
    """[Note: GPU memory estimate] (qualify/request/gpu_memory.py) on every GPU the ranks use; where
    two arms do not fit and one does, one arm at a time unless the command line said
    otherwise (then ``args.one_arm_at_a_time`` is set, and the record's plan says so)."""
    from qwz.qualify.request import gpu_memory
    from qwz.qualify.run.workloads import get_workload

    params = get_workload(args.workload, attention=args.attention).params
    fit = gpu_memory.fit(
        world_size=world_size,
        numel=numel,
        dtype=args.dtype,
        activations=gpu_memory.activation_bytes(params, args.dtype),
        one_arm_at_a_time=args.one_arm_at_a_time,
        may_choose="one_arm_at_a_time" not in args.given and args.warmup_steps >= 1,
        indices=gpu_memory.indices_for_run(world_size, under_torchrun()),
        eager_attention="model" in params and params.get("attention", "eager") == "eager",
    )
    if fit.one_arm and not args.one_arm_at_a_time and not fit.problems:
        print(
            "qwz-qualify run: two arms do not fit on the GPUs with their activations; "
            "holding one arm at a time (--one-arm-at-a-time)",
            file=sys.stderr,
        )
        args.one_arm_at_a_time = True
    return fit.problems


def _deepspeed_problems(args: argparse.Namespace) -> list[str]:
    """``--deepspeed-src`` names a usable checkout for a DeepSpeed subject, whose optimizer
    the harness's seam can read (run/seam_check.py); for
    ``deepspeed-native``, DeepSpeed's own config accepts every arm's config (checked in a
    subprocess with the ranks' import path, qualify/run/subjects.py)."""
    from qwz.qualify.base.plan import DEEPSPEED_SUBJECTS
    from qwz.qualify.run.seam_check import seam_problems
    from qwz.qualify.run.subjects import deepspeed_native_problems

    source = args.deepspeed_src
    if source is not None and args.subject not in DEEPSPEED_SUBJECTS:
        return [f"--deepspeed-src applies to --subject {' or '.join(DEEPSPEED_SUBJECTS)} only"]
    if source is not None and not (source / "deepspeed" / "__init__.py").is_file():
        return [f"--deepspeed-src {source}: no deepspeed/__init__.py there (not a checkout)"]
    # The machine first (what no checkout can change), then the checkout.
    if args.subject in DEEPSPEED_SUBJECTS and args.dtype == "fp16":
        refused = _deepspeed_fp16_problems(args)
        if refused:
            return refused
    if args.subject in DEEPSPEED_SUBJECTS:  # [Note: seam preflight], no import of DeepSpeed
        unreadable = seam_problems(args.subject, source)
        if unreadable:
            return unreadable
    if args.subject not in DEEPSPEED_SUBJECTS:
        return []
    if args.subject == "deepspeed" and args.ds_config is None:
        return []  # the harness's own configs, which stock DeepSpeed accepts
    plan = plan_of(args)
    configs = {arm.name: plan.arm_config(arm) for arm in plan.arms}
    if args.subject == "deepspeed":  # the reference is stock; qwz takes the group size key
        for config in configs.values():
            config["zero_optimization"].pop("zero_quantized_weights_group_size", None)
    return deepspeed_native_problems(str(source) if source else None, configs, args.subject)


def _qwz_config_problems(args: argparse.Namespace) -> list[str]:
    """``--subject qwz`` with ``--ds-config``: qwz's strict config (``qwz.QwzConfig``) accepts
    every arm's config; its refusal (an unsupported key, named) is the user's, before training."""
    if args.subject != "qwz" or args.ds_config is None:
        return []
    from qwz.config import ConfigError, QwzConfig

    plan = plan_of(args)
    refusals: dict[str, str] = {}
    for arm in plan.arms:
        try:
            QwzConfig.from_deepspeed(plan.arm_config(arm))
        except ConfigError as error:
            refusals.setdefault(str(error), arm.name)
    return [
        f"--ds-config {plan.ds_config.path}: qwz's config refuses the {arm} arm's: {message}"
        for message, arm in refusals.items()
    ]


def _deepspeed_fp16_problems(args: argparse.Namespace) -> list[str]:
    """DeepSpeed's accelerator for the ranks' backend must support fp16 (run/subjects.py)."""
    from qwz.qualify.run.launch import pick_backend
    from qwz.qualify.run.subjects import deepspeed_fp16_problems

    world_size = run_world_size(args)
    source = str(args.deepspeed_src) if args.deepspeed_src else None
    return deepspeed_fp16_problems(source, pick_backend(world_size))


def _workload_numel(name: str, seed: int) -> int:
    """Parameters of the workload's model, counted on the meta device (no memory)."""
    import torch

    from qwz.qualify.run.workloads import get_workload

    with torch.device("meta"):
        model = get_workload(name).build_model(seed)
    return sum(parameter.numel() for parameter in model.parameters())


def _local_resource_problems(world_size: int, numel: int) -> list[str]:
    from qwz.qualify.run.launch import pick_backend

    problems = []
    cores = available_cores()
    if world_size > RANKS_PER_CORE * cores:
        problems.append(
            f"--world-size {world_size}: this machine has {cores} CPU core"
            f"{'s' if cores != 1 else ''}; local ranks are limited to {RANKS_PER_CORE} per "
            f"core ({RANKS_PER_CORE * cores}); use torchrun across machines for more"
        )
    available = available_memory_bytes()
    if available is not None and pick_backend(world_size) == "gloo":
        needed = world_size * (RANK_OVERHEAD_BYTES + BYTES_PER_PARAMETER * numel)
        if needed > available:
            problems.append(
                f"--world-size {world_size}: about {needed / 2**30:.1f} GiB of host memory "
                f"needed for {world_size} CPU ranks of {numel:,} parameters, "
                f"{available / 2**30:.1f} GiB available"
            )
    return problems


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_world_size(args: argparse.Namespace) -> int:
    """The ranks of this run: torchrun's world under torchrun, else ``--world-size``."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size or 2


def _has_gpu_per_rank(world_size: int) -> bool:
    """Whether the ranks of this run each get a GPU: under torchrun, where this rank has
    one (the CLI then binds it, cli._run_torchrun); else the launcher's own choice."""
    import torch

    from qwz.qualify.run.launch import pick_backend

    if under_torchrun():
        return torch.cuda.is_available()
    return pick_backend(world_size) == "nccl"


def apply_preset(args: argparse.Namespace) -> Preset:
    """Every setting left unset from ``--preset`` (qualify/base/presets.py), else its declared
    default (qualify/request/settings.py); idempotent."""
    preset = PRESETS[getattr(args, "preset", None) or DEFAULT]
    unset = [name for name in preset.gpu_values if getattr(args, name, None) is None]
    resolved = settings.resolve(args, bool(unset) and _has_gpu_per_rank(run_world_size(args)))
    if preset.every_local_gpu and "world_size" not in args.given and not under_torchrun():
        args.world_size = _local_gpu_count() or args.world_size  # [Note: the PR's evidence]
    return resolved


def _local_gpu_count() -> int:
    """CUDA devices this process sees (counted without creating a context on them)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def apply_ds_config(args: argparse.Namespace) -> list[str]:
    """``--ds-config``, read and applied to the resolved `args` ([Note: the user's DeepSpeed
    config], qualify/request/ds_config.py); idempotent. One line per refusal."""
    from qwz.qualify.request import ds_config
    from qwz.qualify.run.workloads import get_workload

    micro_batch = get_workload(args.workload).params["micro_batch"]
    return ds_config.resolve(args, micro_batch, run_world_size(args))


def plan_of(args: argparse.Namespace) -> RunPlan:
    """The run the parsed ``run`` arguments ask for, with the chunked arm where its bucket does
    not already chunk ([Note: the chunked arm], run/chunked_arm.py) (ValueError: a refused
    ``--ds-config``, which ``check_run_request`` reports first)."""
    from qwz.qualify.run.chunked_arm import chunked_bucket
    from qwz.qualify.run.workloads import get_workload

    apply_preset(args)
    refused = apply_ds_config(args)
    if refused:
        raise ValueError("; ".join(refused))
    values = settings.plan_values(args)
    values["workload"] = get_workload(args.workload, attention=args.attention)
    if args.deepspeed_src is not None:
        values["deepspeed_src"] = str(args.deepspeed_src.resolve())
    values["chunked_allgather_bucket_size"] = chunked_bucket(
        values["workload"],
        world_size=run_world_size(args),
        seed=args.seed,
        group_sizes=args.group_sizes,
        dtype=args.dtype,
        allgather_bucket_size=args.allgather_bucket_size,
    )
    return RunPlan(**values)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
