"""One arm on this rank: built, trained step by step and observed after each step by the arm's
observers (observers/arm_observer.py), its failures every rank agrees on recorded ([Note:
failures] in runner.py).

Per arm and step, on every rank:
1. train one step (the probe counts the gather's bytes, from the step to the next use of the
   weights: [Note: the wire window], wire_window.py);
2. [Note: exact update check] on a sample of this rank's master elements, and the global
   norm of the gradient the optimizer was handed (observers/update.py);
3. at the next use of the weights -- the start of the next forward, or of a final forward
   after the last step ([Note: observed at the next use], next_use.py) -- every own shard
   against the contract's decodes of its master, with the requested group size
   (observers/own_shard.py), the replicas' per-parameter digests across ranks, and the sampled
   values;
4. layout-independent digests of every parameter's master: short ones after every step,
   full ones after step 1 (observers/digest.py);
5. at the evaluation steps, the held-out loss.
A non-finite loss or gradient norm ends the arm and the run goes on with the next
one; any other exception ends the run at once, without a collective, naming the
rank, the arm and the last completed step (
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from qwz import devices
from qwz.optimizer import WORKING_DTYPES, NonFiniteError
from qwz.qualify.base import rank_reports
from qwz.qualify.base.plan import ArmSpec, RunPlan
from qwz.qualify.evidence.observation import ArmObservation
from qwz.qualify.evidence.optimizer import AdamWSettings, adamw_of, clipping_of
from qwz.qualify.run import calibration_noise, heap, next_use, replicas
from qwz.qualify.run.observers import (
    engine_report,
    overflow,
    own_shard,
    step_memory,
    update,
    wire_traffic,
)
from qwz.qualify.run.observers.arm_observer import ArmObserver, Window
from qwz.qualify.run.observers.replica_watch import ReplicaWatch
from qwz.qualify.run.observers.samples import Samples
from qwz.qualify.run.subjects import ArmEngine, make_arm
from qwz.qualify.run.wire_window import WireWindow


class NonFiniteStep(FloatingPointError):
    """A step's loss or gradient norm is NaN/Inf: every rank sees it ([Note: failures])."""


AGREED_FAILURES = (NonFiniteStep, NonFiniteError)
"""Failures every rank raises at the same step, so agreeing on them cannot hang."""


class Progress:
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


def mean_over_ranks(value: torch.Tensor) -> float:
    """[Note: collectives on the group's device] (qwz/devices.py): the all-reduce gets a
    tensor on the group's device, wherever `value` was computed."""
    value = value.detach().float().reshape(1).to(devices.group_device(), copy=True)
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def agree(local: Any) -> list[Any]:
    """Every rank's `local` value, on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return gathered
    return [local]


def _call_hook(plan: RunPlan, arm: ArmSpec, engine: ArmEngine) -> ArmEngine:
    """The plan's ``arm_hook`` may change a candidate arm's engine or return a replacement."""
    if plan.arm_hook is None or not arm.quantized:
        return engine
    import importlib

    module_name, _, function_name = plan.arm_hook.partition(":")
    hook = getattr(importlib.import_module(module_name), function_name)
    return hook(arm, engine, plan) or engine


def build(plan: RunPlan, arm: ArmSpec) -> ArmEngine:
    # Built where it trains and in the dtype it trains in: no fp32 copy on the GPU.
    model = plan.workload.build_model(
        plan.seed, device=devices.group_device(), dtype=WORKING_DTYPES[plan.dtype]
    )
    engine = make_arm(
        plan.subject,
        model,
        plan.arm_config(arm),
        model_parameters=plan.workload.optimizer_parameters(model),
        quantized=arm.quantized,
        # "fused": where they pass their self-test on every rank, else eager with the reason
        # in the record's kernels (qwz.kernels.choose_kernels, collectives.agree_on_kernels).
        fused_kernels=None if plan.kernels == "fused" else False,
        qwz_gather=plan.qwz_gather,
        shard_alignment=plan.shard_alignment,
    )
    return _call_hook(plan, arm, engine)


@torch.no_grad()
def held_out_loss(plan: RunPlan, engine: ArmEngine, rank: int, step: int) -> list[Any]:
    """``[step, mean loss]`` over ranks and held-out batches; under the non-inferiority rule
    ``[step, mean loss, every batch's loss]`` too, rank by rank ([Note: non-inferiority over
    the horizon], qualify/evidence/rules/horizon.py: the batches are its paired units)."""
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        losses = []
        for index in range(plan.held_out_batches):
            batch = plan.workload.held_out_batch(seed=plan.seed, index=index, rank=rank)
            losses.append(plan.workload.loss(module, batch).detach().float())
        stacked = torch.stack(losses)
        total = stacked.sum()  # on the model's device, summed in order
    finally:
        module.train(was_training)
    entry: list[Any] = [step, mean_over_ranks(total / plan.held_out_batches)]
    if plan.learning_rule == "non-inferiority":
        entry.append([loss for per_rank in agree(stacked.cpu().tolist()) for loss in per_rank])
    return entry


def _non_finite(step: int, loss_value: float, grad_norm: float) -> NonFiniteStep:
    return NonFiniteStep(f"step {step}: non-finite loss {loss_value} or gradient norm {grad_norm}")


def _failure(step: int, rank: int, error: BaseException, module: torch.nn.Module) -> dict:
    """One rank's record of an AGREED_FAILURES error ([Note: failures])."""
    message = f"{type(error).__name__}: {error}".splitlines()[0][:2000]
    return {
        "step": step,
        "rank": rank,
        "kind": "non-finite",
        "message": message,
        "parameters": list(
            getattr(error, "parameters", ()) or engine_report.non_finite_parameters(module)
        )[:20],
    }


def _step_boundary(engine: ArmEngine) -> torch.optim.Optimizer | None:
    """The optimizer whose first ``step`` in a training step ends its backward (None: the
    subject's is no torch optimizer; then all data the step moves counts as the gather)."""
    optimizer = getattr(engine, "shard_optimizer", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class _ArmRun:
    """One arm on this rank: built, trained for ``plan.steps`` steps, each step observed by the
    arm's observers (run/observers/arm_observer.py: one per thing observed, each owning the
    fields of the ArmObservation it reports). ``observed`` holds the fields the loop itself
    records (the losses, the held-out losses, the failures, the fp16 scales).

    This class is longer than 150 lines because the step itself -- the failures every rank
    agrees on, the update check's and the overflow watch's parts inside it -- and the order
    of the events read best in one place; what is observed is the observers'."""

    def __init__(
        self,
        plan: RunPlan,
        arm: ArmSpec,
        rank: int,
        progress: Progress,
        samples: dict[str, torch.Tensor] | None,
        reference_samples: dict[str, list[torch.Tensor]] | None,
    ):
        self.plan, self.arm, self.rank, self.progress = plan, arm, rank, progress
        self.samples, self.reference_samples = samples, reference_samples
        self.observed: dict[str, Any] = {"losses": [], "grad_norms": [], "held_out": []}
        self.memory = step_memory.ArmMemory()
        self.sampling: Samples | None = None
        self.observers: list[ArmObserver] = []
        """In the order they hear each event (the memory last: it reads the peak after the
        others let go of the engine)."""
        self.engine: ArmEngine | None = None
        self.update_check: update.UpdateCheck | None = None
        self.fp16 = plan.dtype == "fp16"
        self.clipping = clipping_of(plan.arm_config(arm))
        """[Note: global norm check]'s threshold, read from the arm's config."""
        self.gathered = True
        """Whether the last step ran the weight gather (not an fp16 overflow skip)."""
        """[Note: overflow observation]: steps may be skipped; the evidence judges them."""
        self.overflow_watch: overflow.OverflowWatch | None = None
        self.next_use: next_use.NextUse | None = None
        self.subject_runs: Any = None
        self.wire = WireWindow()
        if self.fp16:
            self.observed.update(loss_scales=[], overflowed=[])

    @property
    def sampled(self) -> dict[str, list[torch.Tensor]]:
        """The sampled values per step (the reference's serve the arms after it)."""
        return self.sampling.sampled if self.sampling is not None else {}

    def build(self) -> None:
        plan, arm = self.plan, self.arm
        engine = self.engine = build(plan, arm)
        self.observed.update(group_size=engine.group_size, reported_by=engine.reported_by)
        named = list(engine.module.named_parameters())
        numel = {name: param.numel() for name, param in named}
        # The shards' tensors are live views, so one call serves every step; which of their
        # elements must travel exactly never changes either.
        shards = engine.own_shards()
        group_ranks = engine.shard_group_ranks()
        replica_keys = plan.workload.replica_keys(engine.module)
        replica_sets = replicas.ReplicaSets.agree(replica_keys)
        layout = wire_traffic.wire_layout(shards, group_ranks, numel, replica_keys)
        # A one-rank gather group copies exactly ([Note: the spec's decode], evidence/spec.py).
        gather_ranks = [len(ranks) for ranks in group_ranks]
        masks = own_shard.exact_masks(shards, arm.group_size, numel, gather_ranks)
        # [Note: the optimizer the update check re-derives]: read from the arm's config; a
        # reason instead of settings: not re-derived, only counted.
        adamw = adamw_of(plan.arm_config(arm))
        self.update_check = update.UpdateCheck(
            shards,
            engine.shard_optimizer,
            adamw if isinstance(adamw, AdamWSettings) else None,
            samples_per_shard=plan.update_samples,
            seed=plan.seed,
            rank=self.rank,
            skips_allowed=self.fp16,
        )
        self.sampling = Samples(engine.module, self.samples, self.reference_samples)
        self.observers = [self.update_check]
        if arm.noise_group_size is None:  # the calibration arm's shards carry its noise
            last = plan.steps
            self.observers.append(
                own_shard.OwnShards(shards, masks, arm.group_size, rank=self.rank, last_step=last)
            )
        self.observers += [
            ReplicaWatch(engine.module, shards, replica_keys, replica_sets),
            self.sampling,
            wire_traffic.WireTraffic(layout, self.rank),
            self.memory,
        ]
        if self.fp16:
            self.overflow_watch = overflow.OverflowWatch(engine.module)
        self.next_use = next_use.NextUse(engine.module, pause=self.memory.peak.paused)
        # Ahead of the subject's own pre-hooks: its memory counts from here ([Note: the wire
        # window], wire_window.py), not from the harness's batch preparation before it.
        self.subject_runs = engine.module.register_forward_pre_hook(
            lambda *_: self.wire.subject_runs(), prepend=True
        )

    def train(self) -> None:
        """Every step, until the last or the first failure every rank agrees on."""
        plan, arm, progress = self.plan, self.arm, self.progress
        self.build()
        if 0 in plan.eval_steps:
            self.observed["held_out"].append(held_out_loss(plan, self.engine, self.rank, 0))
        for step in range(1, plan.steps + 1):
            progress.at(phase="train", arm=arm.name, step=step, last_completed_step=step - 1)
            trained = self.train_step(step)
            if trained is None:
                self.wire.close()  # the step that ended the arm: its window is not read
                break
            loss_value, grad_norm = trained
            self.observe(step, loss_value, grad_norm)
            if step % 5 == 0 or step == plan.steps:
                progress.say(f"{arm.name} step {step}/{plan.steps}: loss {loss_value:.4f}")
        self.next_use.settle(self._final_forward)
        for observer in self.observers:
            observer.end()

    def train_step(self, step: int) -> tuple[float, float] | None:
        """One step: its loss and gradient norm, its wire window left open and suspended
        ([Note: the wire window]); None when every
        rank raised an AGREED_FAILURES error (recorded; the arm ends). In fp16 a non-finite
        loss or norm ends the arm only on a step some rank's optimizer took: a step every
        rank skipped is the evidence's to judge ([Note: overflow pattern])."""
        plan, engine, update_check = self.plan, self.engine, self.update_check
        error: dict[str, Any] | None = None
        # Only AGREED_FAILURES are caught here; anything else ends the run ([Note: failures]).
        try:
            update_check.begin_step(step)
            with self.memory.peak.around_step():
                batch = plan.workload.batch(seed=plan.seed, step=step, rank=self.rank)
                self.wire.resume()
                loss = plan.workload.loss(engine.module, batch)
                if self.overflow_watch is not None:
                    self.overflow_watch.watch(loss)
                # Data moved before the masters' optimizer steps is the backward's.
                self.wire.open(_step_boundary(engine))
                try:
                    engine.train_step(loss)
                finally:
                    self.wire.suspend()
            update_check.end_step()
            loss_value = mean_over_ranks(loss)
            grad_norm = float(engine.grad_norm) if engine.grad_norm is not None else math.nan
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
            if not (finite or self.fp16):
                raise _non_finite(step, loss_value, grad_norm)
        except AGREED_FAILURES as raised:  # every rank raised it: agreed on, the arm ends
            error = _failure(step, self.rank, raised, engine.module)
        if self._agreed_failure(step, error):
            return None
        watch = self.overflow_watch
        agreement = update_check.check_norm(
            grad_norm, self.clipping, None if watch is None else watch.local_overflow
        )
        if watch is not None:
            self.observed["loss_scales"].append(watch.applied_scale())
            self.observed["overflowed"].append(agreement.ranks_overflowed > 0)
            if not finite and agreement.ranks_stepped > 0:  # the values are agreed on
                raised = _non_finite(step, loss_value, grad_norm)
                self._agreed_failure(step, _failure(step, self.rank, raised, engine.module))
                return None
        stepped = agreement.ranks_stepped > 0 or not self.fp16
        self.gathered = stepped  # an overflow-skipped step runs no gather
        if stepped and "first_update_step" not in self.observed:
            self.observed["first_update_step"] = step
        return loss_value, grad_norm

    def _agreed_failure(self, step: int, error: dict[str, Any] | None) -> bool:
        """Whether any rank failed at `step` (collective); the failure is recorded."""
        errors = [item for item in agree(error) if item is not None]
        if errors:
            self.observed["failure"] = errors[0] | {"ranks": sorted({e["rank"] for e in errors})}
            message = errors[0]["message"][:200]
            self.progress.say(f"{self.arm.name}: FAILED at step {step}: {message}")
        return bool(errors)

    def _final_forward(self) -> None:
        """After the last step, one more use of the weights ([Note: observed at the next
        use]): the next training batch in eval mode (no dropout: no random state is drawn),
        its loss discarded."""
        plan, module = self.plan, self.engine.module
        was_training = module.training
        module.eval()
        try:
            batch = plan.workload.batch(seed=plan.seed, step=plan.steps + 1, rank=self.rank)
            self.wire.resume()
            plan.workload.loss(module, batch)
        finally:
            module.train(was_training)

    def observe(self, step: int, loss_value: float, grad_norm: float) -> None:
        """What the harness checks after a completed step, outside the step's memory window;
        what the working copy holds, and what the wire carried, is observed at the weights'
        next use (:meth:`observe_weights`)."""
        plan, arm, engine, observed = self.plan, self.arm, self.engine, self.observed
        observed["losses"].append(loss_value)
        observed["grad_norms"].append(grad_norm)
        if arm.noise_group_size is not None:
            calibration_noise.perturb(engine.module, arm.noise_group_size, plan.seed, step)
        first_update, gathered = observed.get("first_update_step"), self.gathered
        for observer in self.observers:
            observer.after_step(step, first_update)
        self.next_use.defer(
            f"the weights after step {step}",
            lambda: self.observe_weights(step, first_update, gathered),
        )
        if step in plan.eval_steps:
            self.wire.resume()
            observed["held_out"].append(held_out_loss(plan, engine, self.rank, step))

    def observe_weights(self, step: int, first_update_step: int | None, gathered: bool) -> None:
        """The wire and the working copy after `step`, at its next use ([Note: observed at
        the next use]): what the step's window carried, then every observer of the weights."""
        probe = self.wire.close()
        window = Window(probe, self.wire.memory, gathered)
        for observer in self.observers:
            observer.window_closed(window)
        resume = self.progress.where
        self.progress.at(phase="observe", arm=self.arm.name, step=step, last_completed_step=step)
        for observer in self.observers:
            observer.at_next_use(step, first_update_step)
        self.progress.at(**resume)

    def finish(self) -> ArmObservation:
        """The arm's observation; releases its engine (also after a failure that ends the run)."""
        observed = self.observed
        if self.engine is not None:
            observed["kernels"] = engine_report.kernels_used(self.engine, self.rank)
        for observer in self.observers[:-1]:  # the memory last, below
            observed.update(observer.report())
            observer.close()
        if self.overflow_watch is not None:
            self.overflow_watch.close()
        if self.next_use is not None:
            self.next_use.close()
        if self.subject_runs is not None:
            self.subject_runs.remove()
        self.wire.close()
        observed["steps_completed"] = len(observed["losses"])
        observed.update(self.memory.report())
        self.engine = self.update_check = self.subject_runs = None
        self.overflow_watch = self.next_use = None
        self.observers = []
        return ArmObservation(**observed)


def train_arm(
    plan: RunPlan,
    arm: ArmSpec,
    rank: int,
    reference_samples: dict[str, list[torch.Tensor]] | None,
    samples: dict[str, torch.Tensor] | None,
    progress: Progress,
) -> tuple[ArmObservation, dict[str, list[torch.Tensor]]]:
    """Train one arm for plan.steps steps; its observations, and its sampled values per step."""
    heap.release_memory()
    step_memory.reset_peak_memory()
    run = _ArmRun(plan, arm, rank, progress, samples, reference_samples)
    progress.at(phase="build", arm=arm.name, step=0, last_completed_step=0)
    try:
        run.train()
    finally:
        observation = run.finish()
        heap.release_memory()
    return observation, run.sampled
