"""The rank side of a qualification: train the arms, check them step by step, time them.

``qualify_rank(plan)`` runs on every rank of an initialised process group
(spawned by ``qwz.launch`` or started by torchrun) and returns, on rank 0, the
list of every rank's observations; other ranks return None. It drives the
engines only through ``subjects.ArmEngine``.

Phases:
1. *Lockstep trajectory.* The reference and every candidate take ``steps``
   steps on the same batches. After each step a fixed, seeded sample of
   parameter elements of each candidate is compared with the reference against
   [Note: parameter-sample tolerance] (qwz/tolerance.py). The bytes of the weight
   gather are counted by ``WireProbe`` on every step.
2. *Hashes and probe.* Final parameter hash and reported group size per arm.
3. *Performance.* For each candidate, order-balanced blocks against the
   reference (``stats.measure_blocks``), training on, warm-up excluded.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from qwz.hashing import param_hash
from qwz.probe import WireProbe
from qwz.qualify import provenance, stats
from qwz.qualify.subjects import ArmEngine, make_arm
from qwz.qualify.workloads import Workload
from qwz.tolerance import element_bound

REFERENCE = "reference"
BETAS = (0.9, 0.999)


@dataclass(frozen=True)
class ArmSpec:
    name: str
    quantized: bool
    group_size: int | None


@dataclass(frozen=True)
class RunPlan:
    """Everything a qualification run does, as data (picklable, recorded)."""

    workload: Workload
    subject: str = "qwz"
    stage: int = 2
    dtype: str = "bf16"
    group_sizes: tuple[int, ...] = (64,)
    steps: int = 20
    blocks: int = 4
    block_steps: int = 5
    warmup_steps: int = 2
    seed: int = 0
    lr: float = 1e-3
    gradient_clipping: float = 1.0
    allgather_bucket_size: int = 500_000_000
    samples_per_param: int = 64
    compile_kernels: bool = False
    integration_enabled: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def arms(self) -> list[ArmSpec]:
        return [ArmSpec(REFERENCE, False, None)] + [
            ArmSpec(f"candidate-g{size}", True, size) for size in self.group_sizes
        ]

    def arm_config(self, arm: ArmSpec) -> dict[str, Any]:
        """The DeepSpeed-style config of one arm."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "zero_quantized_weights": arm.quantized,
            "allgather_bucket_size": self.allgather_bucket_size,
            "reduce_bucket_size": self.allgather_bucket_size,
        }
        if arm.quantized:
            zero["zero_quantized_weights_group_size"] = arm.group_size
        optimizer_params: dict[str, Any] = {"lr": self.lr, "betas": list(BETAS)}
        if self.subject == "deepspeed":
            # torch's AdamW in both subjects: the same update rule, and no fused-op build.
            optimizer_params["torch_adam"] = True
        return {
            "train_micro_batch_size_per_gpu": self.workload.params["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.gradient_clipping,
            "bf16": {"enabled": self.dtype == "bf16"},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": optimizer_params},
        }


class _Progress:
    """Rank 0 prints a line now and then; other ranks stay quiet."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = time.perf_counter()

    def say(self, text: str) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.started
            print(f"[qwz-qualify {elapsed:6.1f}s] {text}", file=sys.stderr, flush=True)


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _sample_indices(module: torch.nn.Module, count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 7919)
    return {
        name: torch.randperm(param.numel(), generator=generator)[: min(count, param.numel())]
        for name, param in module.named_parameters()
    }


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "kind": "cuda",
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    # ru_maxrss is in KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": "rss", "peak_allocated_bytes": int(rss), "peak_reserved_bytes": None}


def qualify_rank(plan: RunPlan) -> list[dict[str, Any]] | None:
    """Run the plan on this rank; rank 0 gets every rank's observations."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = _Progress(rank == 0)
    workload = plan.workload
    engines: dict[str, ArmEngine] = {}
    for arm in plan.arms:
        engines[arm.name] = make_arm(
            plan.subject,
            workload.build_model(plan.seed),
            plan.arm_config(arm),
            quantized=arm.quantized,
            compile_kernels=plan.compile_kernels,
            integration_enabled=plan.integration_enabled,
        )
    reference = engines[REFERENCE]
    candidates = [arm for arm in plan.arms if arm.quantized]
    working_dtype = next(reference.module.parameters()).dtype
    samples = _sample_indices(reference.module, plan.samples_per_param, plan.seed)
    progress.say(
        f"{plan.subject}: {len(engines)} arms, {plan.steps} lockstep steps, "
        f"{plan.blocks} blocks x {plan.block_steps} steps per candidate"
    )

    losses: dict[str, list[float]] = {arm.name: [] for arm in plan.arms}
    grad_norms: dict[str, list[float]] = {arm.name: [] for arm in plan.arms}
    gather_bytes: dict[str, int] = {}
    tolerance = {
        arm.name: {
            "checked": 0,
            "violations": 0,
            "max_ratio": 0.0,
            "max_abs_error": 0.0,
            "own_shard_max_ratio": 0.0,
        }
        for arm in candidates
    }
    for step in range(1, plan.steps + 1):
        for arm in plan.arms:
            engine = engines[arm.name]
            batch = workload.batch(seed=plan.seed, step=step, rank=rank)
            loss = workload.loss(engine.module, batch)
            with WireProbe() as probe:
                engine.train_step(loss)
            gather_bytes[arm.name] = probe.bytes["gather"]
            losses[arm.name].append(_mean_over_ranks(loss))
            grad_norms[arm.name].append(float(engine.grad_norm))
        reference_params = dict(reference.module.named_parameters())
        for arm in candidates:
            ratio = engines[arm.name].own_shard_decode_ratio()
            if ratio is not None:
                totals = tolerance[arm.name]
                totals["own_shard_max_ratio"] = max(totals["own_shard_max_ratio"], ratio)
            _compare_sample(
                engines[arm.name],
                reference_params,
                samples,
                step,
                plan,
                working_dtype,
                tolerance[arm.name],
            )
        if step % 5 == 0 or step == plan.steps:
            summary = ", ".join(f"{name} {values[-1]:.4f}" for name, values in losses.items())
            progress.say(f"step {step}/{plan.steps}: loss {summary}")

    observation: dict[str, Any] = {
        "rank": rank,
        "num_parameters": sum(p.numel() for p in reference.module.parameters()),
        "device_name": provenance.device_name(),
        "losses": losses,
        "grad_norms": grad_norms,
        "gather_bytes": gather_bytes,
        "tolerance": tolerance,
        "hashes": {name: param_hash(engine.module) for name, engine in engines.items()},
        "group_sizes": {name: engine.group_size for name, engine in engines.items()},
    }

    timings: dict[str, list[dict[str, Any]]] = {}
    # Batches are made before the clock starts: data generation is not the step under test.
    perf_steps = len(candidates) * plan.blocks * 2 * (plan.warmup_steps + plan.block_steps)
    batches = iter(
        [
            workload.batch(seed=plan.seed, step=plan.steps + offset, rank=rank)
            for offset in range(1, perf_steps + 1)
        ]
    )

    def one_step(engine: ArmEngine) -> None:
        engine.train_step(workload.loss(engine.module, next(batches)))

    for arm in candidates:
        blocks = stats.measure_blocks(
            lambda: one_step(reference),
            lambda engine=engines[arm.name]: one_step(engine),
            blocks=plan.blocks,
            block_steps=plan.block_steps,
            warmup_steps=plan.warmup_steps,
            sync=_sync,
        )
        timings[arm.name] = [block._asdict() for block in blocks]
        speedups = stats.block_speedups(blocks)
        progress.say(
            f"{arm.name}: block speed-ups " + ", ".join(f"{value:.3f}" for value in speedups)
        )
    observation["timings"] = timings
    observation["memory"] = _peak_memory()
    if rank == 0:
        observation["head"] = provenance.git_head().model_dump()
        observation["subject"] = provenance.subject(plan.subject).model_dump()
    gathered: list[Any] = [observation]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, observation)
    if rank == 0:
        names = [item["device_name"] for item in gathered]
        gathered[0]["environment"] = provenance.environment(names).model_dump()
        return gathered
    return None


def _compare_sample(
    candidate: ArmEngine,
    reference_params: dict[str, torch.nn.Parameter],
    samples: dict[str, torch.Tensor],
    step: int,
    plan: RunPlan,
    working_dtype: torch.dtype,
    totals: dict[str, Any],
) -> None:
    for name, param in candidate.module.named_parameters():
        index = samples[name].to(param.device)
        cand = param.detach().reshape(-1)[index].float()
        ref = reference_params[name].detach().reshape(-1)[index].float()
        scales = candidate.element_scales(name).reshape(-1).to(param.device)[index]
        bound = element_bound(step, plan.lr, BETAS, scales, ref, cand, working_dtype)
        error = (cand - ref).abs()
        totals["checked"] += int(index.numel())
        totals["violations"] += int((error > bound).sum())
        totals["max_ratio"] = max(totals["max_ratio"], float((error / bound).max()))
        totals["max_abs_error"] = max(totals["max_abs_error"], float(error.max()))


def plan_dict(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-friendly data for the record."""
    data = dataclasses.asdict(plan)
    data["workload"] = {"name": plan.workload.name, "params": plan.workload.params}
    data["group_sizes"] = list(plan.group_sizes)
    return data
