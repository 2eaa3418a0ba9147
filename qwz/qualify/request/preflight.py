"""Pre-flight: everything that can be known wrong about a resolved ``run`` request before the
first rank starts -- the subject's flags, repeated arms, a world size that cannot judge the
gather, ``--out`` (an earlier run there, [Note: results kept] in evidence/run_dir.py), the
ledger, the signing key, group sizes against the shards, the bucket size (requirements.py),
local cores and host memory, GPU memory (gpu_memory.py), a ``--timeout`` shorter than the run
can take (time_floor.py) -- so a bad request costs nothing (exit 2), never a finished run's
evidence. ``problems(request)`` reads the request ([Note: a request resolved once],
run_request.py) and the machine, and changes neither.
"""

from __future__ import annotations

import os

from qwz.qualify.base.plan import DEEPSPEED_SUBJECTS
from qwz.qualify.request import settings
from qwz.qualify.request.run_request import RunRequest

RANKS_PER_CORE = 4
"""Local ranks allowed per CPU core: beyond this a run only thrashes (gloo ranks spin)."""
RANK_OVERHEAD_BYTES = 400 * 2**20
"""Host memory of one idle rank: the interpreter, torch and its allocator."""
BYTES_PER_PARAMETER = 20
"""Host memory per parameter per CPU rank, conservatively: working copy and gradient
(fp32, unsharded), fp32 master and two Adam moments (counted unsharded)."""


def problems(request: RunRequest) -> list[str]:
    """Every reason ``run`` would fail after training or cannot be served; one line each."""
    from qwz.qualify.request import requirements

    plan, launch = request.plan, request.launch
    found = _repeated_values(request) + _one_rank_problems(request)
    if not plan.qwz_gather and plan.subject != "deepspeed":
        found.append("--no-qwz-gather applies to --subject deepspeed only")
    if plan.arm_set == "reference" and launch.min_speedup is not None:
        found.append(
            "--min-speedup gates the candidates' speed-up: --arm-set reference trains none"
        )
    if plan.one_arm_at_a_time and plan.warmup_steps < 1:  # given (the fit never chooses it)
        found.append("--one-arm-at-a-time needs --warmup-steps >= 1 (arms are rebuilt then)")
    torchrun_differs = request.under_torchrun and launch.world_size != request.world_size
    if torchrun_differs and "world_size" in request.given:
        found.append(
            f"--world-size {launch.world_size} contradicts torchrun's {request.world_size}"
        )
    found += _deepspeed_problems(request)
    found += _qwz_config_problems(request)
    found += _output_problems(request)
    if request.refusals:  # what follows would build the model, which these refuse
        return found + list(request.refusals)
    found += _group_size_problems(request)
    found += requirements.bucket_size_problems(
        request.numel, request.world_size, plan.allgather_bucket_size
    )
    if not request.under_torchrun:
        found += _local_resource_problems(request)
        found += _timeout_problems(request)
    return found + (request.memory.problems if request.memory else [])


def _repeated_values(request: RunRequest) -> list[str]:
    """A value given twice to a repeated flag (``--group-size 64 --group-size 64``): each is
    one arm, and two arms of one name cannot be recorded (the matrix spec refuses it too)."""
    found = []
    for name, setting in settings.run_settings().items():
        if not setting.declaration.repeated or name not in request.given:
            continue
        values = list(request.value(name))
        for value in sorted({value for value in values if values.count(value) > 1}):
            found.append(
                f"{setting.flag} {value} is given {values.count(value)} times: each value "
                "is one arm; give it once"
            )
    return found


def _one_rank_problems(request: RunRequest) -> list[str]:
    """One rank sends nothing to quantize: the run could only end INCONCLUSIVE ([Note: one
    rank] in qualify/evidence/rules/in_effect.py), known now. ``--allow-one-rank`` runs it anyway (a
    smoke test of the harness on one device)."""
    if request.world_size != 1 or request.allow_one_rank:
        return []
    where = "torchrun's world is 1" if request.under_torchrun else "--world-size 1"
    return [
        f"{where}: one rank sends nothing to quantize, so the gather cannot be judged (the run "
        "would end INCONCLUSIVE); use 2 or more ranks, or --allow-one-rank for a smoke test"
    ]


def _group_size_problems(request: RunRequest) -> list[str]:
    """A group size larger than a rank's whole shard of the model."""
    plan, numel, world_size = request.plan, request.numel, request.world_size
    largest_shard = -(-numel // world_size)
    largest_group = -(-largest_shard // 8) * 8
    return [
        f"--group-size {group_size}: larger than a rank's whole shard of the "
        f"{plan.workload.name} model ({numel:,} parameters / {world_size} ranks = "
        f"{largest_shard:,}); at most {largest_group:,}"
        for group_size in plan.group_sizes
        if group_size > largest_group
    ]


def _timeout_problems(request: RunRequest) -> list[str]:
    """[Note: the time floor] (qualify/request/time_floor.py): local ranks only."""
    from qwz.qualify.request.time_floor import time_floor, timeout_problem

    plan = request.plan
    arms = plan.arms
    floor = time_floor(
        workload=plan.workload.name,
        arms=len(arms),
        timed_candidates=sum(arm.timed for arm in arms),
        steps=plan.steps,
        blocks=plan.blocks,
        warmup_steps=plan.warmup_steps,
        block_steps=plan.block_steps,
        on_cpu=request.backend == "gloo",
    )
    problem = timeout_problem(request.launch.timeout, floor, plan.workload.name)
    return [problem] if problem else []


def _output_problems(request: RunRequest) -> list[str]:
    """``--out``, the ledger and the signing key: what the run writes and signs with."""
    from qwz.qualify.base.files import writable_directory_problem
    from qwz.qualify.evidence import ledger, run_dir, signing

    found = []
    out, keep = request.out, request.keep_previous
    out_problem = writable_directory_problem(out, "--out")
    if out_problem:
        found.append(out_problem)
    elif keep is not None and request.under_torchrun:  # every rank starts writing into --out
        found.append("--keep-previous: not under torchrun; give each run its own --out")
    elif keep is not None:
        found += filter(None, [run_dir.keep_previous_problem(out, keep)])
    elif run_dir.holds_a_run(out) and not request.force:  # [Note: results kept]
        present = [name for name in run_dir.RUN_FILES if (out / name).exists()]
        found.append(
            f"--out {out}: already holds an earlier run ({', '.join(present)}); pass "
            "--force to replace it, --keep-previous N to move it aside, or choose another "
            "directory"
        )
    if request.launch.ledger is not None:
        found += ledger.validate_directory(request.launch.ledger)
    try:
        signing.configured_key()
    except signing.SigningKeyError as error:
        found.append(str(error))
    return found


def _deepspeed_problems(request: RunRequest) -> list[str]:
    """``--deepspeed-src`` names a usable checkout for a DeepSpeed subject, whose optimizer
    the harness's seam can read (run/seam_check.py); for ``deepspeed-native``, DeepSpeed's
    own config accepts every arm's config (checked in a subprocess with the ranks' import
    path, qualify/run/subjects.py)."""
    from qwz.qualify.run.seam_check import seam_problems
    from qwz.qualify.run.subjects import deepspeed_native_problems

    plan, source = request.plan, request.deepspeed_src
    if source is not None and plan.subject not in DEEPSPEED_SUBJECTS:
        return [f"--deepspeed-src applies to --subject {' or '.join(DEEPSPEED_SUBJECTS)} only"]
    if source is not None and not (source / "deepspeed" / "__init__.py").is_file():
        return [f"--deepspeed-src {source}: no deepspeed/__init__.py there (not a checkout)"]
    if plan.subject not in DEEPSPEED_SUBJECTS:
        return []
    # The machine first (what no checkout can change), then the checkout.
    if plan.dtype == "fp16":
        refused = _deepspeed_fp16_problems(request)
        if refused:
            return refused
    unreadable = seam_problems(plan.subject, source)  # [Note: seam preflight], no import
    if unreadable:
        return unreadable
    if plan.subject == "deepspeed" and plan.ds_config is None:
        return []  # the harness's own configs, which stock DeepSpeed accepts
    configs = {arm.name: plan.arm_config(arm) for arm in plan.arms}
    if plan.subject == "deepspeed":  # the reference is stock; qwz takes the group size key
        for config in configs.values():
            config["zero_optimization"].pop("zero_quantized_weights_group_size", None)
    return deepspeed_native_problems(str(source) if source else None, configs, plan.subject)


def _qwz_config_problems(request: RunRequest) -> list[str]:
    """``--subject qwz`` with ``--ds-config``: qwz's strict config (``qwz.QwzConfig``) accepts
    every arm's config; its refusal (an unsupported key, named) is the user's, before training."""
    plan = request.plan
    if plan.subject != "qwz" or plan.ds_config is None:
        return []
    from qwz.config import ConfigError, QwzConfig

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


def _deepspeed_fp16_problems(request: RunRequest) -> list[str]:
    """DeepSpeed's accelerator for the ranks' backend must support fp16 (run/subjects.py)."""
    from qwz.qualify.run.subjects import deepspeed_fp16_problems

    source = str(request.deepspeed_src) if request.deepspeed_src else None
    return deepspeed_fp16_problems(source, request.backend)


def _local_resource_problems(request: RunRequest) -> list[str]:
    """Local ranks: at most RANKS_PER_CORE per core, and host memory for the CPU ranks."""
    world_size, numel = request.world_size, request.numel
    found = []
    cores = available_cores()
    if world_size > RANKS_PER_CORE * cores:
        found.append(
            f"--world-size {world_size}: this machine has {cores} CPU core"
            f"{'s' if cores != 1 else ''}; local ranks are limited to {RANKS_PER_CORE} per "
            f"core ({RANKS_PER_CORE * cores}); use torchrun across machines for more"
        )
    available = available_memory_bytes()
    if available is not None and request.backend == "gloo":
        needed = world_size * (RANK_OVERHEAD_BYTES + BYTES_PER_PARAMETER * numel)
        if needed > available:
            found.append(
                f"--world-size {world_size}: about {needed / 2**30:.1f} GiB of host memory "
                f"needed for {world_size} CPU ranks of {numel:,} parameters, "
                f"{available / 2**30:.1f} GiB available"
            )
    return found


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    from qwz.qualify.evidence.machine import meminfo_bytes

    return meminfo_bytes("MemAvailable")
