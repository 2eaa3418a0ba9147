"""The rank side of a qualification: train the arms one after another, observe every step,
then time them.

``qualify_rank(plan)`` runs on every rank of an initialised process group
(spawned by ``qwz.launch`` or started by torchrun) and returns, on rank 0, the
list of every rank's observations; other ranks return None. It drives engines
only through ``subjects.ArmEngine`` (the seam of [Note: own shards]).

[Note: arms one at a time]
The arms -- the unquantized ``reference``, the ``calibration`` arm (the
reference with quantization-sized noise, [Note: learning margin] in
qualify/checks.py) and one candidate per group size -- train one after another,
each from the same seed and on the same batches; only one is resident at a
time, and each arm's peak memory is measured from a reset (CUDA peak stats, or
the process's peak RSS via /proc/self/clear_refs), so a configuration that
fits the cards with one arm can be qualified on them. What must be compared
across arms is kept as observations: per-step losses and gradient norms,
held-out losses at fixed steps, step-1 master digests, sampled parameter values
(drift, context only). The speed blocks then pair the reference with each
candidate ([Note: order-balanced blocks], stats.py); with
``one_arm_resident`` the arm is rebuilt at every switch, during the untimed
warm-up, so even the timing holds one arm at a time.

Per arm and step, on every rank:
1. train one step (the probe counts the gather's bytes);
2. [Note: exact update check] on a sample of this rank's master elements;
3. every own shard against the spec's decode of its master, with the requested group size,
   and the global norm of the gradient the optimizer was handed (observers.py);
4. the replicas' per-parameter digests agree across ranks;
5. at step 1, layout-independent digests of every parameter's master;
6. at the evaluation steps, the held-out loss.
A non-finite loss or gradient norm ends the arm and the run goes on with the next
one; any other exception ends the run at once, without a collective, naming the
rank, the arm and the last completed step ([Note: failures]).

[Note: failures]
Two kinds, told apart by who sees them:
- Seen by every rank together: a non-finite loss (the loss is averaged over the
  ranks) or gradient norm (a global norm), raised here as NonFiniteStep, and
  qwz's NonFiniteError (raised on every rank with the same text, after its own
  all-gather). Every rank stands at the same point, so ``_agree`` (an
  all_gather_object) is safe: the failure is recorded with the step, the ranks
  and the parameters, the arm ends, the next arm runs.
- Seen by one rank: anything else raised while building an arm, in a step, in a
  check, while timing (a CUDA OOM, a bug, a rank's lost peer). Its peers may be
  inside a collective this rank will never enter, so no collective may follow:
  the rank reports the exception and where it was (``_Progress.at``: arm, phase,
  step, last completed step) through the launcher's side channel and aborts the
  process group (qwz.rank_reports.crash). The launcher stops the others and
  names the rank that failed first ([Note: the rank that failed first]); the
  CLI writes a "crash" record, keeping the arms every rank finished (reported
  with rank_reports.report_result) and marking those never started "not run".
  A rank that dies (SIGKILL) or hangs is found by the launcher the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from qwz import devices, rank_reports
from qwz.hashing import param_hash
from qwz.optimizer import WORKING_DTYPES, NonFiniteError
from qwz.probe import WireProbe
from qwz.qualify import determinism, gather_timing, machine, observers, provenance, spec, stats
from qwz.qualify.subjects import DEEPSPEED_SUBJECTS, ArmEngine, make_arm, use_deepspeed_source
from qwz.qualify.workloads import Workload

REFERENCE = "reference"
CALIBRATION = "calibration"
"""Role and name prefix of the calibration arm: ``calibration-g<G>`` imitates group size G."""
BETAS = (0.9, 0.999)
EPS = 1e-8


@dataclass(frozen=True)
class ArmSpec:
    name: str
    quantized: bool
    group_size: int | None
    noise_group_size: int | None = None
    """Calibration arm only: the group size whose quantization error the noise imitates."""


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
    weight_decay: float = 0.1
    """Set explicitly (and nonzero) so that a candidate dropping it is caught."""
    gradient_clipping: float = 1.0
    allgather_bucket_size: int = 500_000_000
    samples_per_param: int = 64
    """Drift context: sampled elements per parameter compared with the reference."""
    update_samples: int = 512
    """[Note: exact update check]: sampled master elements per shard and rank."""
    eval_every: int = 5
    """Held-out evaluation every this many steps (and at step 0 and the last step)."""
    held_out_batches: int = 2
    """Held-out batches per rank and evaluation."""
    calibrate: bool = True
    """Train the calibration arm ([Note: learning margin])."""
    one_arm_resident: bool = False
    compile_kernels: bool = False
    integration_enabled: bool = True
    deepspeed_src: str | None = None
    """``--deepspeed-src``: the DeepSpeed checkout every rank imports ([Note: subject
    identity], qualify/subjects.py); None: the installed deepspeed."""
    arm_hook: str | None = None
    """Test seam: ``"module:function"`` called as ``function(arm_spec, arm_engine, plan)``
    after each candidate arm is built, in every rank; it may change the engine or return a
    replacement. The mutation suite uses it to inject broken candidates; it is recorded in
    the record's plan, so a record says when it ran."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def arms(self) -> list[ArmSpec]:
        arms = [ArmSpec(REFERENCE, False, None)]
        if self.calibrate:
            size = max(self.group_sizes)
            arms.append(ArmSpec(f"{CALIBRATION}-g{size}", False, None, size))
        return arms + [ArmSpec(f"candidate-g{size}", True, size) for size in self.group_sizes]

    @property
    def eval_steps(self) -> list[int]:
        every = max(1, self.eval_every)
        return sorted({0, self.steps, *range(every, self.steps + 1, every)})

    @property
    def adamw(self) -> observers.AdamWSettings:
        return observers.AdamWSettings(self.lr, BETAS, EPS, self.weight_decay)

    @property
    def shard_alignment(self) -> int | None:
        """The shard alignment every arm's engine is built with: the least common multiple
        of the run's group sizes, so the reference, the calibration arm and every candidate
        share one layout and reduce gradients in one order ([Note: padding rule],
        qwz/layout.py). None for the deepspeed subject, whose arms keep DeepSpeed's own
        partitioning, the same in every arm (qwz's gather reads it, never changes it)."""
        if self.subject != "qwz":
            return None
        return math.lcm(*self.group_sizes)

    def arm_config(self, arm: ArmSpec) -> dict[str, Any]:
        """The DeepSpeed-style config of one arm.

        A candidate carries the request as a user writes it: ``zero_quantized_weights:
        true`` and ``zero_quantized_weights_group_size: G``. For ``deepspeed-native`` the
        group size key is left out at the proposal's default, G = 64 -- what a user who
        wants the default writes, and what DeepSpeed 0.19's strict config accepts (so stock
        0.19 trains and FAILs ``in-effect``); any other G is written, and a DeepSpeed whose
        config refuses the key is refused before training."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "zero_quantized_weights": arm.quantized,
            "allgather_bucket_size": self.allgather_bucket_size,
            "reduce_bucket_size": self.allgather_bucket_size,
        }
        native_default = self.subject == "deepspeed-native" and arm.group_size == 64
        if arm.quantized and not native_default:
            zero["zero_quantized_weights_group_size"] = arm.group_size
        optimizer_params: dict[str, Any] = {
            "lr": self.lr,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": self.weight_decay,
        }
        if self.subject in DEEPSPEED_SUBJECTS:
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


class NonFiniteStep(FloatingPointError):
    """A step's loss or gradient norm is NaN/Inf: every rank sees it ([Note: failures])."""


AGREED_FAILURES = (NonFiniteStep, NonFiniteError)
"""Failures every rank raises at the same step, so agreeing on them cannot hang."""


class _Progress:
    """Rank 0 prints a line now and then; other ranks stay quiet. Every rank tells its
    launcher where it is ([Note: failures])."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = time.perf_counter()
        self.where: dict[str, Any] = {"phase": "start"}

    def say(self, text: str) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.started
            print(f"[qwz-qualify {elapsed:6.1f}s] {text}", file=sys.stderr, flush=True)

    def at(self, **where: Any) -> None:
        """Replace where this rank is (``phase``, ``arm``, ``step``, ``last_completed_step``)."""
        self.where = where
        rank_reports.report_progress(**where)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_over_ranks(value: torch.Tensor) -> float:
    """[Note: collectives on the group's device] (qwz/devices.py): the all-reduce gets a
    tensor on the group's device, wherever `value` was computed."""
    value = value.detach().float().reshape(1).to(devices.group_device(), copy=True)
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _agree(local: Any) -> list[Any]:
    """Every rank's `local` value, on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return gathered
    return [local]


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


def _release_memory() -> None:
    """Return freed memory to the device and the OS, so the next arm's peak is its own."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "kind": "cuda",
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    return {
                        "kind": "rss",
                        "peak_allocated_bytes": peak,
                        "peak_reserved_bytes": None,
                    }
    except OSError:
        pass
    # ru_maxrss (KiB on Linux) cannot be reset: the process-wide peak.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": "rss", "peak_allocated_bytes": int(rss), "peak_reserved_bytes": None}


class _StepPeak:
    """[Note: peak around the train step]
    An arm's memory is its training step's: forward, backward, reductions, optimizer step
    and gather, with the arm's resident state. The counter is reset before each step's
    forward and read right after its gather, and the record keeps the largest step; the
    harness's own checks (own-shard decode, digests, held-out loss) run outside that
    window, so what they allocate is not charged to the subject. An arm that never
    completed a step reports the peak since the arm began instead."""

    def __init__(self) -> None:
        self.steps = 0
        self.peak: dict[str, Any] | None = None

    @contextlib.contextmanager
    def around_step(self):
        _reset_peak_memory()
        yield
        measured = _peak_memory()
        self.steps += 1
        if self.peak is None:
            self.peak = measured
            return
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            if measured[key] is not None:
                self.peak[key] = max(self.peak[key] or 0, measured[key])

    def result(self) -> dict[str, Any]:
        assert self.peak is not None
        return dict(self.peak)


# ------------------------------------------------------------------- arms


def _call_hook(plan: RunPlan, arm: ArmSpec, engine: ArmEngine) -> ArmEngine:
    """The plan's ``arm_hook`` may change a candidate arm's engine or return a replacement."""
    if plan.arm_hook is None or not arm.quantized:
        return engine
    import importlib

    module_name, _, function_name = plan.arm_hook.partition(":")
    hook = getattr(importlib.import_module(module_name), function_name)
    return hook(arm, engine, plan) or engine


def _build(plan: RunPlan, arm: ArmSpec) -> ArmEngine:
    # Built where it trains and in the dtype it trains in: no fp32 copy on the GPU.
    model = plan.workload.build_model(
        plan.seed, device=devices.group_device(), dtype=WORKING_DTYPES[plan.dtype]
    )
    engine = make_arm(
        plan.subject,
        model,
        plan.arm_config(arm),
        quantized=arm.quantized,
        compile_kernels=plan.compile_kernels,
        integration_enabled=plan.integration_enabled,
        shard_alignment=plan.shard_alignment,
    )
    return _call_hook(plan, arm, engine)


@torch.no_grad()
def _held_out_loss(plan: RunPlan, engine: ArmEngine, rank: int) -> float:
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        losses = []
        for index in range(plan.held_out_batches):
            batch = plan.workload.held_out_batch(seed=plan.seed, index=index, rank=rank)
            losses.append(plan.workload.loss(module, batch).detach().float())
        total = torch.stack(losses).sum()  # on the model's device, summed in order
    finally:
        module.train(was_training)
    return _mean_over_ranks(total / plan.held_out_batches)


@torch.no_grad()
def _perturb(engine: ArmEngine, group_size: int, seed: int, step: int) -> None:
    """[Note: learning margin]: add noise of the quantization error's size to the working
    copy of every quantized parameter -- uniform in [-scale/2, scale/2] per group of
    `group_size` elements of the parameter, drawn from one seed on every rank, so the
    replicas stay identical and the masters are untouched (the next gather overwrites it)."""
    generator = torch.Generator().manual_seed(seed * 1_000_033 + step)
    for param in engine.module.parameters():
        if spec.travels_exactly(param.numel()):
            continue
        flat = param.detach().reshape(-1)
        padded = -(-flat.numel() // group_size) * group_size
        values = torch.nn.functional.pad(flat.float().cpu(), (0, padded - flat.numel()))
        scales = spec.scales(values, group_size).repeat_interleave(group_size)
        noise = (torch.rand(padded, generator=generator) - 0.5) * scales
        flat.add_(noise[: flat.numel()].to(flat.device, flat.dtype))


def _failure(step: int, rank: int, error: BaseException, module: torch.nn.Module) -> dict:
    """One rank's record of an AGREED_FAILURES error ([Note: failures])."""
    message = f"{type(error).__name__}: {error}".splitlines()[0][:2000]
    return {
        "step": step,
        "rank": rank,
        "kind": "non-finite",
        "message": message,
        "parameters": list(
            getattr(error, "parameters", ()) or observers.non_finite_parameters(module)
        )[:20],
    }


def empty_observation(failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """What one rank observes of one arm, before its first step (or when it never ran)."""
    return {
        "losses": [],
        "grad_norms": [],
        "held_out": [],
        "step1_digests": None,
        "update": None,
        "own_shard": None,
        "kernels": None,
        "replica_divergence": None,
        "drift_max_abs": [],
        "gather_bytes": 0,
        "final_hash": None,
        "group_size": None,
        "reported_by": None,
        "wire": [],
        "failure": failure,
        "steps_completed": 0,
        "memory": {"kind": "rss", "peak_allocated_bytes": 0, "peak_reserved_bytes": None},
    }


def _wire_layout(
    shards: list, group_ranks: list[tuple[int, ...]], numel: dict[str, int]
) -> dict[tuple[int, ...], dict[str, int]]:
    """Per process group, the spec's counts of this rank's own-shard elements there
    ([Note: group size from the wire], qualify/checks.py): quantized (parameters above
    spec.EXACT_MAX_NUMEL), exact (at most), padding (no parameter) and the working element size."""
    layout: dict[tuple[int, ...], dict[str, int]] = {}
    for shard, ranks in zip(shards, group_ranks, strict=True):
        counts = layout.setdefault(
            ranks,
            {"quantized_numel": 0, "exact_numel": 0, "padding_numel": 0, "element_bytes": 0},
        )
        covered = 0
        for slot in shard.slots:
            kind = "exact_numel" if spec.travels_exactly(numel[slot.name]) else "quantized_numel"
            counts[kind] += slot.end - slot.start
            covered += slot.end - slot.start
        counts["padding_numel"] += shard.master.numel() - covered
        counts["element_bytes"] = shard.working.element_size()
    return layout


def _wire(probe: WireProbe, layout: dict, rank: int) -> list[dict[str, Any]]:
    """This step's gather bytes and calls per process group, with the group's counts."""
    return [
        {
            "rank": rank,
            "group_ranks": list(ranks),
            "bytes_per_step": int(probe.gather_bytes_by_group[ranks]),
            "calls_per_step": int(probe.gather_calls_by_group[ranks]),
            **counts,
        }
        for ranks, counts in layout.items()
    ]


def _train_arm(
    plan: RunPlan,
    arm: ArmSpec,
    rank: int,
    reference_samples: dict[str, list[torch.Tensor]] | None,
    samples: dict[str, torch.Tensor] | None,
    progress: _Progress,
) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
    """Train one arm for plan.steps steps; its observations, and its sampled values per step."""
    workload = plan.workload
    _release_memory()
    _reset_peak_memory()
    obs = empty_observation()
    sampled: dict[str, list[torch.Tensor]] = {}
    engine: ArmEngine | None = None
    update_check: observers.UpdateCheck | None = None
    peak = _StepPeak()
    progress.at(phase="build", arm=arm.name, step=0, last_completed_step=0)
    # Only AGREED_FAILURES are caught here; anything else ends the run ([Note: failures]).
    try:
        engine = _build(plan, arm)
        obs["group_size"], obs["reported_by"] = engine.group_size, engine.reported_by
        module = engine.module
        names = [name for name, _ in module.named_parameters()]
        numel = {name: param.numel() for name, param in module.named_parameters()}
        # The shards' tensors are live views, so one call serves every step; which of their
        # elements must travel exactly never changes either.
        shards = engine.own_shards()
        wire_layout = _wire_layout(shards, engine.shard_group_ranks(), numel)
        exact_masks = observers.exact_masks(shards, arm.group_size, numel)
        update_check = observers.UpdateCheck(
            shards,
            engine.shard_optimizer,
            plan.adamw,
            samples_per_shard=plan.update_samples,
            seed=plan.seed,
            rank=rank,
        )
        own_result = observers.OwnShardResult()
        check_own = arm.noise_group_size is None
        if 0 in plan.eval_steps:
            obs["held_out"].append([0, _held_out_loss(plan, engine, rank)])
        for step in range(1, plan.steps + 1):
            progress.at(phase="train", arm=arm.name, step=step, last_completed_step=step - 1)
            error: dict[str, Any] | None = None
            try:
                update_check.begin_step(step)
                with peak.around_step():
                    batch = workload.batch(seed=plan.seed, step=step, rank=rank)
                    loss = workload.loss(module, batch)
                    with WireProbe() as probe:
                        engine.train_step(loss)
                update_check.end_step()
                loss_value = _mean_over_ranks(loss)
                grad_norm = float(engine.grad_norm) if engine.grad_norm is not None else math.nan
                if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                    raise NonFiniteStep(
                        f"step {step}: non-finite loss {loss_value} or gradient norm {grad_norm}"
                    )
            except AGREED_FAILURES as raised:  # every rank raised it: agreed on, the arm ends
                error = _failure(step, rank, raised, module)
            errors = [item for item in _agree(error) if item is not None]
            if errors:
                obs["failure"] = errors[0] | {"ranks": sorted({e["rank"] for e in errors})}
                progress.say(f"{arm.name}: FAILED at step {step}: {errors[0]['message'][:200]}")
                break
            update_check.check_norm(grad_norm, plan.gradient_clipping)
            obs["losses"].append(loss_value)
            obs["grad_norms"].append(grad_norm)
            obs["gather_bytes"] = int(probe.bytes["gather"])
            obs["wire"] = _wire(probe, wire_layout, rank)
            if arm.noise_group_size is not None:
                _perturb(engine, arm.noise_group_size, plan.seed, step)
            if check_own:
                observers.check_own_shards(
                    shards, exact_masks, arm.group_size, step, rank, own_result
                )
            divergent = observers.replica_divergence(module)
            if divergent and obs["replica_divergence"] is None:
                obs["replica_divergence"] = {"step": step, "parameters": divergent[:20]}
            if step == 1:
                obs["step1_digests"] = observers.master_digests(shards, names)
            if samples is not None:
                params = dict(module.named_parameters())
                values = {
                    name: params[name]
                    .detach()
                    .reshape(-1)[index.to(params[name].device)]
                    .float()
                    .cpu()
                    for name, index in samples.items()
                }
                for name, value in values.items():
                    sampled.setdefault(name, []).append(value)
                if reference_samples is not None:
                    obs["drift_max_abs"].append(
                        max(
                            float((value - reference_samples[name][step - 1]).abs().max())
                            for name, value in values.items()
                        )
                    )
            if step in plan.eval_steps:
                obs["held_out"].append([step, _held_out_loss(plan, engine, rank)])
            if step % 5 == 0 or step == plan.steps:
                progress.say(f"{arm.name} step {step}/{plan.steps}: loss {loss_value:.4f}")
        if check_own:
            obs["own_shard"] = dataclasses.asdict(own_result)
        obs["final_hash"] = param_hash(module)
    finally:
        if engine is not None:
            obs["kernels"] = observers.kernels_used(engine, rank)
        if update_check is not None:
            obs["update"] = dataclasses.asdict(update_check.result)
            update_check.close()
        obs["steps_completed"] = len(obs["losses"])
        obs["memory"] = peak.result() if peak.steps else _peak_memory()
        del engine, update_check
        _release_memory()
    return obs, sampled


def _timing(plan: RunPlan, candidates: list[ArmSpec], rank: int, progress: _Progress) -> dict:
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
                if plan.one_arm_resident:
                    resident.clear()
                    _release_memory()
                resident[spec.name] = _build(plan, spec)
            engine = resident[spec.name]
            with gather_timing.timed_gather(engine) as clock:
                engine.train_step(workload.loss(engine.module, next(batches)))
            return clock.read  # read after the step's sync ([Note: gather phase timing])

        blocks = stats.measure_blocks(
            lambda: step_of(reference_spec),
            lambda arm=arm: step_of(arm),
            blocks=plan.blocks,
            block_steps=plan.block_steps,
            warmup_steps=plan.warmup_steps,
            sync=_sync,
        )
        resident.clear()
        _release_memory()
        timings[arm.name] = [block._asdict() for block in blocks]
        speedups = stats.block_speedups(blocks)
        progress.say(f"{arm.name}: block speed-ups " + ", ".join(f"{v:.3f}" for v in speedups))
    return timings


def qualify_rank(plan: RunPlan) -> list[dict[str, Any]] | None:
    """Run the plan on this rank under [Note: deterministic ranks] (determinism.py); rank 0
    gets every rank's observations. A failure only this rank sees ends the run through
    rank_reports.crash ([Note: failures])."""
    rank, world_size = _rank_and_world()
    if plan.subject in DEEPSPEED_SUBJECTS:
        use_deepspeed_source(plan.deepspeed_src)
    progress = _Progress(rank == 0)
    if dist.is_initialized():
        devices.use_cpu_accelerator_for_gloo(str(dist.get_backend()))
    try:
        with determinism.deterministic() as settings:
            return _qualify(plan, rank, world_size, progress, settings)
    except Exception as error:
        rank_reports.crash(error, **progress.where)


def _qualify(
    plan: RunPlan, rank: int, world_size: int, progress: _Progress, settings: Any
) -> list[dict[str, Any]] | None:
    progress.say(
        f"{plan.subject}: {len(plan.arms)} arms one after another, {plan.steps} steps each, "
        f"then {plan.blocks} blocks x {plan.block_steps} steps per candidate"
    )
    with torch.device("meta"):  # shapes only: the sample indices and the parameter count
        probe_model = plan.workload.build_model(plan.seed)
    samples = _sample_indices(probe_model, plan.samples_per_param, plan.seed)
    num_parameters = sum(p.numel() for p in probe_model.parameters())
    del probe_model
    arms: dict[str, dict[str, Any]] = {}
    reference_samples: dict[str, list[torch.Tensor]] | None = None
    for arm in plan.arms:
        obs, sampled = _train_arm(
            plan,
            arm,
            rank,
            None if arm.name == REFERENCE else reference_samples,
            samples,
            progress,
        )
        if arm.name == REFERENCE:
            reference_samples = sampled if obs["failure"] is None else None
        arms[arm.name] = obs
        rank_reports.report_result(arm.name, obs)  # kept by the launcher if the run crashes

    # Arms that failed are not timed; without a working reference nothing is.
    timed = [arm for arm in plan.arms if arm.quantized and arms[arm.name]["failure"] is None]
    timings = {}
    if arms[REFERENCE]["failure"] is None and plan.blocks > 0:
        timings = _timing(plan, timed, rank, progress)

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
    if rank == 0:
        observation.update(provenance.code_under_test(plan.subject))
    progress.at(phase="gather observations")
    gathered = _agree(observation)
    if rank == 0:
        names = [item["device_name"] for item in gathered]
        capabilities = [item["compute_capability"] for item in gathered]
        machines = [item["machine"] for item in gathered]
        environment = provenance.environment(names, capabilities, settings, machines)
        gathered[0]["environment"] = environment.model_dump()
        return gathered
    return None


def plan_dict(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-friendly data for the record."""
    data = dataclasses.asdict(plan)
    data["workload"] = {"name": plan.workload.name, "params": plan.workload.params}
    data["group_sizes"] = list(plan.group_sizes)
    return data
