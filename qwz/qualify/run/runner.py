"""The rank side of a qualification: train the arms one after another, observe every step,
then time them.

``qualify_rank(plan)`` runs on every rank of an initialised process group
(spawned by ``qwz.qualify.run.launch`` or started by torchrun) and returns, on rank 0, the
list of every rank's observations; other ranks return None. It drives engines
only through ``subjects.ArmEngine`` (the seam of [Note: own shards]).

The arms -- the unquantized ``reference``, the ``calibration`` arm (the
reference with quantization-sized noise, [Note: learning margin] in
qualify/evidence/rules/learning.py) and one candidate per group size -- train one after another,
each from the same seed and on the same batches; only one is resident at a
time, and each arm's peak memory is measured from a reset (CUDA peak stats, or
the process's peak RSS via /proc/self/clear_refs), so a configuration that
fits the cards with one arm can be qualified on them. What must be compared
across arms is kept as observations: per-step losses and gradient norms,
held-out losses at fixed steps, step-1 master digests, sampled parameter values
(drift, context only). The speed blocks then pair the reference with each
candidate ([Note: order-balanced blocks], evidence/stats.py; timed by run/timing.py); with
``one_arm_at_a_time`` the arm is rebuilt at every switch, during the untimed
warm-up, so even the timing holds one arm at a time.

One arm's steps, and what is observed after each, are arm_run.py's.

[Note: failures]
Two kinds, told apart by who sees them:
- Seen by every rank together: a non-finite loss (the loss is averaged over the
  ranks) or gradient norm (a global norm), raised here as NonFiniteStep, and
  qwz's NonFiniteError (raised on every rank with the same text, after its own
  all-gather). Every rank stands at the same point, so ``agree`` (an
  all_gather_object) is safe: the failure is recorded with the step, the ranks
  and the parameters, the arm ends, the next arm runs.
- Seen by one rank: anything else raised while building an arm, in a step, in a
  check, while timing (a CUDA OOM, a bug, a rank's lost peer). Its peers may be
  inside a collective this rank will never enter, so no collective may follow:
  the rank reports the exception and where it was (``arm_run.Progress.at``: arm, phase,
  step, last completed step) through the launcher's side channel and aborts the
  process group (qwz.qualify.base.rank_reports.crash). The launcher stops the others and
  names the rank that failed first ([Note: the rank that failed first]); the
  CLI writes a "crash" record, keeping the arms every rank finished (reported
  with rank_reports.report_result) and marking those never started "not run".
  A rank that dies (SIGKILL) or hangs is found by the launcher the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qwz import devices
from qwz.integrations.deepspeed import structure
from qwz.qualify.base import rank_reports
from qwz.qualify.base.plan import DEEPSPEED_SUBJECTS, REFERENCE, ArmSpec, RunPlan
from qwz.qualify.evidence import machine, provenance, stats
from qwz.qualify.evidence.observation import ArmObservation
from qwz.qualify.run import arm_run, determinism, gather_timing, heap, quantizer_op, timing
from qwz.qualify.run.subjects import ArmEngine, DeepSpeedSourceError, use_deepspeed_source


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


# ------------------------------------------------------------------------ memory


# ------------------------------------------------------------------- arms


def _timing(
    plan: RunPlan, candidates: list[ArmSpec], rank: int, progress: arm_run.Progress
) -> dict:
    workload = plan.workload
    timings: dict[str, list[dict[str, Any]]] = {}
    perf_steps = len(candidates) * plan.blocks * 2 * (plan.warmup_steps + plan.block_steps)
    # Batches are made before the clock starts: data generation is not the step under test.
    batches = iter(
        [
            workload.batch(seed=plan.seed, step=plan.steps + offset, rank=rank)
            for offset in range(1, perf_steps + 1)
        ]
    )
    reference_spec = plan.arms[0]
    for arm in candidates:
        progress.at(phase="timing", arm=arm.name)
        resident: dict[str, ArmEngine] = {}

        def step_of(spec: ArmSpec, resident: dict[str, ArmEngine] = resident):
            if spec.name not in resident:
                if plan.one_arm_at_a_time:
                    resident.clear()
                    heap.release_memory()
                resident[spec.name] = arm_run.build(plan, spec)
            engine = resident[spec.name]
            with gather_timing.timed_gather(engine) as clock:
                engine.train_step(workload.loss(engine.module, next(batches)))
            return clock.read  # read after the step's sync ([Note: gather phase timing])

        blocks = timing.measure_blocks(
            lambda: step_of(reference_spec),
            lambda arm=arm: step_of(arm),
            blocks=plan.blocks,
            block_steps=plan.block_steps,
            warmup_steps=plan.warmup_steps,
            sync=_sync,
        )
        resident.clear()
        heap.release_memory()
        timings[arm.name] = [block._asdict() for block in blocks]
        speedups = stats.block_speedups(blocks)
        progress.say(f"{arm.name}: block speed-ups " + ", ".join(f"{v:.3f}" for v in speedups))
    return timings


def _timed(plan: RunPlan, arms: dict[str, ArmObservation]) -> list[ArmSpec]:
    """The arms timed against the reference: the candidates that did not fail, or, where the
    reference trains alone (arm_set "reference"), the reference itself: its step times, and
    their noise."""
    if plan.arm_set == "reference":
        return [plan.arms[0]]
    return [arm for arm in plan.arms if arm.timed and arms[arm.name].failure is None]


def _same_deepspeed_everywhere(gathered: list[dict[str, Any]]) -> None:
    """[Note: subject identity]: every rank judged the same DeepSpeed (version, commit, path);
    ranks that imported different ones observed no one subject: a harness error."""
    seen = {item["rank"]: item["deepspeed"] for item in gathered if "deepspeed" in item}
    if len(set(seen.values())) > 1:
        raise DeepSpeedSourceError(
            "the ranks imported different DeepSpeeds: "
            + "; ".join(f"rank {rank}: {identity}" for rank, identity in sorted(seen.items()))
        )


def qualify_rank(plan: RunPlan) -> list[dict[str, Any]] | None:
    """Run the plan on this rank under [Note: deterministic ranks] (determinism.py); rank 0
    gets every rank's observations. A failure only this rank sees ends the run through
    rank_reports.crash ([Note: failures])."""
    rank, world_size = _rank_and_world()
    progress = arm_run.Progress(rank == 0)
    if dist.is_initialized():
        devices.use_cpu_accelerator_for_gloo(str(dist.get_backend()))
    try:
        if plan.subject in DEEPSPEED_SUBJECTS:
            use_deepspeed_source(plan.deepspeed_src)
            quantizer_op.install(plan.cpu_quantizer)
        with determinism.deterministic() as settings, heap.frozen_heap():
            return _qualify(plan, rank, world_size, progress, settings)
    except Exception as error:
        rank_reports.crash(quantizer_op.explained(error), **progress.where)


def _train_arms(
    plan: RunPlan, rank: int, samples: dict[str, torch.Tensor], progress: arm_run.Progress
) -> dict[str, ArmObservation]:
    """Every arm, one after another (the module docstring says why); each arm's observation is
    reported as it ends, so the launcher keeps it if the run crashes later."""
    arms: dict[str, ArmObservation] = {}
    reference_samples: dict[str, list[torch.Tensor]] | None = None
    for arm in plan.arms:
        against = None if arm.name == REFERENCE else reference_samples
        obs, sampled = arm_run.train_arm(plan, arm, rank, against, samples, progress)
        if arm.name == REFERENCE:
            reference_samples = sampled if obs.failure is None else None
        arms[arm.name] = obs
        rank_reports.report_result(arm.name, obs)
    return arms


def _qualify(
    plan: RunPlan, rank: int, world_size: int, progress: arm_run.Progress, settings: Any
) -> list[dict[str, Any]] | None:
    refusals = plan.workload.refusals(plan.subject, world_size)
    if refusals:  # the CLI refuses these before any rank starts; torchrun and tests get here
        raise ValueError("; ".join(refusals))
    if plan.subject in DEEPSPEED_SUBJECTS:
        progress.say(f"{plan.subject}: {structure.deepspeed_identity()}")
    progress.say(
        f"{plan.subject}: {len(plan.arms)} arms one after another, {plan.steps} steps each, "
        f"then {plan.blocks} blocks x {plan.block_steps} steps per candidate"
    )
    with torch.device("meta"):  # shapes only: the sample indices and the parameter count
        probe_model = plan.workload.build_model(plan.seed)
    samples = _sample_indices(probe_model, plan.samples_per_param, plan.seed)
    num_parameters = sum(p.numel() for p in probe_model.parameters())
    del probe_model
    arms = _train_arms(plan, rank, samples, progress)
    timings = {}
    if arms[REFERENCE].failure is None and plan.blocks > 0:
        timings = _timing(plan, _timed(plan, arms), rank, progress)

    observation: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "num_parameters": num_parameters,
        "device_name": provenance.device_name(),
        "compute_capability": provenance.compute_capability(),
        "machine": machine.rank_machine(),
        "arms": arms,
        "timings": timings,
    }
    if plan.subject in DEEPSPEED_SUBJECTS:
        observation["deepspeed"] = structure.deepspeed_identity()
        observation["substituted_ops"] = quantizer_op.substituted()
    if rank == 0:
        observation.update(provenance.code_under_test(plan.subject))
    progress.at(phase="gather observations")
    gathered = arm_run.agree(observation)
    if rank == 0:
        _same_deepspeed_everywhere(gathered)
        names = [item["device_name"] for item in gathered]
        capabilities = [item["compute_capability"] for item in gathered]
        machines = [item["machine"] for item in gathered]
        environment = provenance.environment(names, capabilities, settings, machines)
        gathered[0]["environment"] = environment.model_dump()
        return gathered
    return None
