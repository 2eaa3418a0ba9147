"""ZeroOptimizer: ZeRO-1/2 data parallelism with a bounded, quantized weight all-gather.

This file is longer than 600 lines because it is the optimizer and its design document: the
design below, then the one class that implements it (its size says why on the class).

Design
======

Every rank holds a full *working copy* of the model (bf16, fp16 or fp32) for forward
and backward, but only 1/W of the *optimizer*: an fp32 master copy of its own
shard of the parameters and the optimizer state (Adam moments) for that shard.

Buffers
-------
The trainable parameters are packed into flat working buffers, and every
module parameter becomes a view into one of them (so the model sees the
gathered values without copies). There are two buffers, called regions:

* ``quantized`` -- parameters with more than ``preserve_numel`` elements. Its
  gather sends int8 codes + fp32 scales (or, with quantization off, the
  working dtype through the very same chunking: the reference arm).
* ``exact`` -- the small parameters (biases, norms): the exact region. They
  always travel exactly in the working dtype: they are cheap, and quantizing a
  norm's few values buys nothing ([Note: small parameters travel exactly],
  layout.py, says why qwz gives them a region and the DeepSpeed drop-in does not).

Each region is padded per [Note: padding rule] (layout.py): rank ``r`` owns the
slice ``[r * shard_numel, (r + 1) * shard_numel)`` of it, and in the quantized
region that slice is a whole number of ``shard_alignment`` elements (the group
size by default, or a multiple of it), so a group never spans two owners.
Optimizers that must reduce to the same bits -- a qualification's arms at
different group sizes -- are built with one ``shard_alignment``.

One optimizer step, in communication phases
-------------------------------------------
1. *Gradient reduction.* Stage 1 keeps a full fp32 gradient accumulator and
   all-reduces it at the accumulation boundary, in buckets of
   ``reduce_bucket_size`` elements; each rank then reads its own shard.
   Stage 2 reduce-scatters after *every* backward (bucketed the same way) into
   an fp32 accumulator of the owned shard only, and frees the parameters'
   gradients, so between micro-batches a rank keeps only its shard of the
   gradient (the flattening uses a transient full-size fp32 buffer during the
   reduction). Both average over ranks. The collectives run in ``reduce_dtype``
   (the engine passes DeepSpeed's choice for the same config:
   ``communication_data_type``, else the working dtype), and the accumulators
   are ``accumulate_dtype`` (fp32 unless ``data_types.grad_accum_dtype`` says
   otherwise); the reduction is the same in the reference and the quantized
   arm, so it does not bias a comparison. In fp16 each rank divides its gradient by W
   before the collective, as DeepSpeed does, so the sum of W loss-scaled fp16 gradients
   cannot overflow where each was finite; in bf16 and fp32 the sum is divided after the
   collective, in fp32 (the same values for a power-of-two W).
2. *Norm and clipping.* Each rank squares and sums its shard in float64 (eager
   unless ``fused_norm``: [Note: the norm's kernel]); one all-reduce gives the
   global gradient norm (reported per step), which stays on the device. In fp16 with
   loss scaling a non-finite norm is an overflow: every rank skips the update and the
   gather together ([Note: dynamic loss scale], loss_scale.py). Otherwise a non-finite
   norm raises :class:`NonFiniteError` on every rank, naming the step and the
   affected parameters (all ranks take the branch together, since they see the
   same reduced value, so nobody hangs). Then gradients are clipped to
   ``gradient_clipping`` if set, by a coefficient that stays a device tensor. A
   non-finite gradient skips the step: nothing changes but the dropped gradients.
3. *Shard update.* The torch optimizer (AdamW, Adam or SGD) steps the fp32
   master shard only. Updated weights that are not finite, or beyond the working
   dtype's range (65504 in fp16: the cast would make them inf), raise on every rank before
   any working copy is touched (the master and optimizer state have taken the
   update by then, and the error says so).
4. *Weight gather.* ``collectives.gather`` moves every master shard into
   every working buffer, chunk by chunk, one collective per chunk: the
   quantized region's groups and, in the same rows, an even share of the exact
   region ([Note: wire row], quant.py), double-buffered through staging
   allocated once and bounded by ``allgather_bucket_size`` ([Note: staging
   bound], layout.py; [Note: gather pipeline], collectives.py). Every rank,
   the owner included, writes the decoded values, so replicas are
   bit-identical after every step while the master stays exact
   ([Note: replica consistency], collectives.py).

With ``world_size == 1`` the same code runs and the collectives are skipped.

[Note: host reads in a step]
A step reads the device on the host twice, each time one flag that every rank holds
alike (it was all-reduced), and nothing else; both decide a host call the semantics put
before a change of state:

1. *Is the reduced gradient norm finite?* -- before the torch optimizer steps. Its step is
   a host call that changes the masters and its own state (moments, step count), and
   neither an fp16 overflow skip nor :class:`NonFiniteError` may leave them changed, so
   whether to make the call is decided on the host. Deciding it on the device instead
   (a ``torch.where`` over the update) would need a copy of the masters and both moments
   on every step: three times the shard again in memory. The same read answers fp16's
   ``engine.step()`` (whether it stepped) and moves the loss scale (host numbers).
2. *Are the updated masters within the working dtype's range?* -- before the gather
   writes any working copy, which :class:`NonFiniteError` must leave untouched. The flag
   is all-reduced right after the update, but read only by the gather, just before its
   first decode (:func:`collectives.gather`'s ``before_first_write``): by then the first
   chunks are packed and their collectives launched, so on a GPU the host waits while they
   run (the decode must wait for them anyway) instead of draining the queue.

Everything else stays on the device: the norm (the engine reads it only when asked,
``Engine.global_grad_norm``), the clip coefficient, both flags until their one read. The
error paths read what they need to name the parameters; a step that raises has no
hot path left. tests/unit/core/test_host_syncs.py counts the reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qwz import collectives, layout, shards
from qwz.collectives import GatherStats
from qwz.kernels import choose_kernels, torch_compile
from qwz.kernels.self_tests import first_line
from qwz.policies import GatherPolicy, OptimizerSpec, ReducePolicy

WORKING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteError(FloatingPointError):
    """A gradient or an updated weight is NaN/Inf (or, for an updated weight, beyond the
    working dtype's range); raised on every rank with the same text. ``parameters`` names
    the affected parameters (every rank's, sorted); ``what`` is ``"gradient"`` or
    ``"updated weight"``."""

    parameters: tuple[str, ...] = ()
    what: str = ""


class StepOutcome(NamedTuple):
    """What one optimizer step did; the norm left on the device ([Note: host reads in a
    step])."""

    grad_norm: torch.Tensor
    """0-dim fp32 on the device: the global norm of the unscaled gradient, before clipping
    (non-finite when an fp16 overflow skipped the step)."""
    stepped: bool
    """Whether the masters stepped and the weights were gathered (False: an fp16 overflow
    skipped the step on every rank)."""


@dataclass
class Region:
    """One flat working buffer, its layout, this rank's master shard and gradient accumulator."""

    name: str
    layout: layout.FlatLayout
    params: list[torch.nn.Parameter]
    working: torch.Tensor
    """(padded_numel,) working dtype; every parameter of the region is a view into it."""
    master: torch.nn.Parameter
    """(shard_numel,) fp32: this rank's shard, the only copy the optimizer steps."""
    grad_accumulator: torch.Tensor
    """(padded_numel,) with stage 1, (shard_numel,) with stage 2; `accumulate_dtype`."""
    quantize: bool

    def shard_range(self, rank: int) -> tuple[int, int]:
        return self.layout.shard_range(rank)


_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
"""The argument defaults of DeepSpeed's FusedAdam and DeepSpeedCPUAdam (deepspeed/ops/adam)."""


def _build_torch_optimizer(
    kind: str, params: dict[str, Any], masters: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's ``_configure_basic_optimizer`` would build for the same
    config section, with the same hyperparameters.

    [Note: DeepSpeed's optimizer defaults]
    DeepSpeed passes the config's ``params`` to the optimizer it builds and nothing else, so a
    missing hyperparameter (``lr`` included: DeepSpeed does not require one) is that
    optimizer's default. For Adam and AdamW it builds its own FusedAdam (or
    DeepSpeedCPUAdam) unless ``torch_adam`` is true: their defaults are
    ``_FUSED_ADAM_DEFAULTS`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0), where
    ``torch.optim.AdamW`` defaults ``weight_decay`` to 0.01; with ``torch_adam`` it builds
    torch's class, so torch's defaults apply. ``"AdamW"`` is always decoupled; ``"Adam"`` is
    decoupled (AdamW) unless ``adam_w_mode`` is false, then L2 (torch.optim.Adam, which
    FusedAdam's mode 0 matches). SGD is ``torch.optim.SGD`` with the given arguments in both
    (a missing ``lr`` is torch's default, 1e-3 since torch 2.2).

    Adam and AdamW run torch's ``foreach`` implementation: bit for bit the default
    single-tensor loop's update (same operations, same order, whatever the shard layout),
    without its full-size temporaries. torch's ``fused=True`` kernel rounds differently
    depending on where an element sits in a vector lane, so the same model sharded another
    way would train differently; it is not used, however fast."""
    params = dict(params)
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = params.pop("adam_w_mode", True)
    if kind == "sgd":
        return torch.optim.SGD(masters, **params)
    if not torch_adam:
        params = {**_FUSED_ADAM_DEFAULTS, **params}
    if kind == "adamw" or (kind == "adam" and adam_w_mode):
        return torch.optim.AdamW(masters, **params, foreach=True)
    return torch.optim.Adam(masters, **params, foreach=True)


NORM_CHUNK_NUMEL = 1 << 24
"""Elements squared in float64 at a time by the eager :func:`_sum_of_squares` (128 MiB)."""


def _sum_of_squares(values: torch.Tensor, fused: bool) -> torch.Tensor:
    """Sum of squares in float64.

    [Note: sharding-independent norm]
    A float32 square is exact in float64, and a float64 sum of them rounds about 2**-29 of
    a float32 ulp, so the norm -- and the clipping coefficient cast to float32 -- does not
    depend on how the gradient is sharded (the world size, the group size's padding), except
    in the rare case where the float64 value sits on a float32 rounding boundary. The
    qualification relies on this for its step-1 exactness check across group sizes.
    `fused`: one pass fused by torch.compile; else eager, widening a bounded chunk at a time
    (:data:`NORM_CHUNK_NUMEL`), so the float64 copy never holds the whole shard. Which of the
    two a step uses: [Note: the norm's kernel]."""
    if fused:
        return _fused_sum_of_squares()(values)
    total = torch.zeros((), dtype=torch.float64, device=values.device)
    for start in range(0, values.numel(), NORM_CHUNK_NUMEL):
        chunk = values[start : start + NORM_CHUNK_NUMEL].to(torch.float64)
        total += torch.dot(chunk, chunk)
    return total


def _squares_float64(values: torch.Tensor) -> torch.Tensor:
    widened = values.to(torch.float64)
    return (widened * widened).sum()


@functools.cache
def _fused_sum_of_squares():
    # dynamic=True: one kernel for every shard length, so no engine hits a recompile limit;
    # the cache keyed by environment: [Note: compile cache per environment]
    # (kernels/compile_cache.py).
    return torch_compile(_squares_float64, dynamic=True)


NORM_SELF_TEST_NUMEL = 100_003
"""Elements of the vector the fused norm must agree on with the eager one before it serves
(odd, so no vector width divides it)."""


@functools.cache
def _fused_norm_self_test(device: torch.device) -> str | None:
    """Why the fused norm cannot serve on `device` (None when it can): it must compile, and
    the float32 norm it gives (the value a step reports and clips with) must equal the
    eager kernel's on a ramp of mixed magnitudes."""
    values = torch.linspace(-3.0, 5.0, NORM_SELF_TEST_NUMEL, device=device)
    values = values * torch.linspace(0.5, 1.5, NORM_SELF_TEST_NUMEL, device=device)
    try:
        fused, eager = (_sum_of_squares(values, f).sqrt().float() for f in (True, False))
    except Exception as error:  # any failure means: eager, and say why
        return first_line(error)
    if not torch.equal(fused, eager):
        return f"fused norm {fused.item()!r} != eager norm {eager.item()!r} on the self-test"
    return None


def choose_norm(fused_norm: bool, device: torch.device) -> bool:
    """Whether the gradient norm runs fused: only when `fused_norm` asks for it, and then
    only if :func:`_fused_norm_self_test` passes on `device` (else raise).

    [Note: the norm's kernel]
    The norm (phase 2) has two kernels of its own, :func:`_sum_of_squares` eager or fused by
    ``torch.compile``, and its own choice: the gather's kernels say nothing about it. A fused
    gather is qwz's native C kernels on CPU, which need no ``torch.compile`` at all, and a
    self-test of the wire bytes is no check of a float64 reduction. The norm is eager unless
    ``fused_norm=True`` because that is what serves it by default: the eager kernel needs no
    compiler, costs no compile when a process starts (every rank pays it), and cannot load a
    graph compiled for another environment -- the failure [Note: compile cache per
    environment] records was a fused norm's (2.21 for 2.97). Its price is one bounded float64
    pass over this rank's gradient shard per step, slower than the fused pass on CPU; a run
    where that matters asks for the fused norm, which serves only after it agrees with the
    eager kernel on a self-test vector on the device. Both sum in float64, so the float32 norm
    a step uses is the same from either but in the rare case of [Note: sharding-independent
    norm]'s rounding boundary."""
    if not fused_norm:
        return False
    reason = _fused_norm_self_test(torch.device(device))
    if reason is not None:
        raise RuntimeError(f"fused_norm=True but the fused norm fails here: {reason}")
    return True


class ZeroOptimizer:
    """ZeRO-1/2 over `named_params` (all of one working dtype); see the module docstring.

    This class is longer than 150 lines because its phases -- reduce, step, gather, and the
    state they share (the regions, the masters, the chunk plan) -- read as one design, top
    to bottom with the module docstring; the math and the collectives are quant.py's and
    collectives.py's."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        stage: int,
        optimizer: OptimizerSpec,
        gather: GatherPolicy,
        reduce: ReducePolicy,
        gradient_clipping: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        fused_norm: bool = False,
    ):
        if stage not in (1, 2):
            raise ValueError(f"stage: {stage} is invalid: ZeroOptimizer implements stages 1 and 2")
        if not named_params:
            raise ValueError("named_params: empty; there is nothing to optimize")
        self.stage = stage
        self.gather = gather
        self.reduce = reduce
        self.group_size = gather.group_size
        self.shard_alignment = gather.resolved_shard_alignment
        """Quantized-region shards are whole multiples of this ([Note: padding rule])."""
        self.gradient_clipping = gradient_clipping
        self.process_group = process_group
        self._place(named_params)
        self._choose_gather_kernels()
        self.fused_norm = choose_norm(fused_norm, self.device)
        """Whether the gradient norm runs fused ([Note: the norm's kernel]; eager by default)."""
        self.regions = self._build_regions(named_params)
        self.gather_plan = self._plan_gather()
        """One plan for the whole weight gather (both regions, one collective per chunk)."""
        self.staging = collectives.Staging(self.device)
        self.staging.reserve(self.gather_plan)
        self.optimizer = _build_torch_optimizer(
            optimizer.type, optimizer.params, [region.master for region in self.regions]
        )
        self.last_gather: dict[str, GatherStats] = {}
        self._has_gradients = False
        # Scratch buffers reused every step (a fresh multi-megabyte allocation per step costs
        # page faults on CPU and allocator churn on GPU): the flattened gradient of each
        # region per dtype, the reduce-scatter output and this rank's shard of the gradient.
        self._flat_grads: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._reduced: dict[str, torch.Tensor] = {}
        self._shard_grads: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup

    def _place(self, named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """This rank's place in the group, the working dtype and device (all parameters
        share them) and the dtype the gradient collectives run in."""
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(self.process_group) if distributed else 1
        self.rank = dist.get_rank(self.process_group) if distributed else 0
        self.dtype = named_params[0][1].dtype
        self.device = named_params[0][1].device
        for name, param in named_params:
            if param.dtype != self.dtype:
                raise ValueError(f"{name}: dtype {param.dtype} differs from {self.dtype}")
        self.reduce_dtype = self.dtype if self.reduce.dtype is None else self.reduce.dtype
        """Dtype of the gradient collectives (default: the working dtype)."""
        self._divide_before_reduce = self.reduce_dtype == torch.float16 and self.world_size > 1
        """fp16 collectives average before they sum (phase 1 of the module docstring)."""

    def _choose_gather_kernels(self) -> None:
        """The gather's kernels, the same kind on every rank (qwz.kernels.choose_kernels,
        then collectives.agree_on_kernels)."""
        choice = collectives.agree_on_kernels(
            choose_kernels(self.gather.fused_kernels, self.device, self.dtype),
            self.process_group,
            self.world_size,
            self.device,
        )
        self.kernels = choice.kernels
        """The gather's kernels: fused by default when they work on every rank."""
        self.kernel_fallback = choice.fallback_reason
        """Why the fused kernels are not in use although wanted (None when they are)."""

    def _build_regions(
        self, named_params: Sequence[tuple[str, torch.nn.Parameter]]
    ) -> list[Region]:
        """The exact region (small parameters, element by element) and the quantized one
        (whole multiples of the shard alignment), each only when it has members."""
        exact, large = layout.split_by_size(
            [(name, param.shape) for name, param in named_params], self.gather.preserve_numel
        )
        by_name = dict(named_params)
        regions = []
        for region_name, members, shard_alignment, quantize in (
            ("exact", exact, 1, False),
            ("quantized", large, self.shard_alignment, self.gather.quantize),
        ):
            if members:
                regions.append(
                    self._build_region(region_name, members, by_name, shard_alignment, quantize)
                )
        return regions

    def _build_region(
        self,
        name: str,
        members: list[tuple[str, torch.Size]],
        by_name: dict[str, torch.nn.Parameter],
        shard_alignment: int,
        quantize: bool,
    ) -> Region:
        flat = layout.build_layout(members, self.world_size, shard_alignment)
        working = torch.zeros(flat.padded_numel, dtype=self.dtype, device=self.device)
        params = [by_name[slot.name] for slot in flat.slots]
        with torch.no_grad():
            for slot, param in zip(flat.slots, params, strict=True):
                working[slot.offset : slot.end].copy_(param.reshape(-1))
                param.data = working[slot.offset : slot.end].view(slot.shape)
            # [Note: replicas start identical] (engine.py): rank 0's initial weights win.
            if self.world_size > 1:
                dist.broadcast(working, src=self._global_rank(0), group=self.process_group)
        start, end = flat.shard_range(self.rank)
        master = torch.nn.Parameter(working[start:end].to(torch.float32).clone())
        accumulator_numel = flat.padded_numel if self.stage == 1 else flat.shard_numel
        return Region(
            name=name,
            layout=flat,
            params=params,
            working=working,
            master=master,
            grad_accumulator=torch.zeros(
                accumulator_numel, dtype=self.reduce.accumulate_dtype, device=self.device
            ),
            quantize=quantize,
        )

    def _plan_gather(self) -> layout.GatherPlan:
        """The main stream is the quantized region when there is one (quantized, or in the
        working dtype for the reference arm); the exact region rides in its rows."""
        main, exact = self.regions[-1], self._exact_region()
        return layout.plan_gather(
            world_size=self.world_size,
            source_numel=main.layout.shard_numel,
            quantize=main.quantize,
            # A chunk of the quantized region is whole groups (its shard, a multiple of the
            # shard alignment, is too); the exact region alone moves element by element.
            group_size=self.group_size if main.name == "quantized" else None,
            element_size=main.working.element_size(),
            bucket_bytes=self.gather.bucket_size * torch.finfo(self.dtype).bits // 8,
            exact_numel=0 if exact is None else exact.layout.shard_numel,
        )

    def _exact_region(self) -> Region | None:
        """The exact region when it rides along the quantized one (None otherwise)."""
        if len(self.regions) == 2:
            return self.regions[0]
        return None

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    # ------------------------------------------------------------- public API

    @property
    def quantization_group_size(self) -> int | None:
        """The group size in force for the weight gather on this rank; None when not quantizing."""
        return self.group_size if self.gather.quantize else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups (to read or change `lr`)."""
        return self.optimizer.param_groups

    def accumulate_gradients(self) -> None:
        """Move this micro-batch's gradients into the fp32 accumulators and free them.

        Stage 1 adds the full gradient locally; stage 2 reduce-scatters it so only the
        owned shard is kept (phase 1 of the module docstring)."""
        for region in self.regions:
            if self.stage == 1:
                flat_grad = self._flatten_grads(region, region.grad_accumulator.dtype)
                region.grad_accumulator.add_(flat_grad)
            else:
                flat_grad = self._flatten_grads(region, self.reduce_dtype)
                if self._divide_before_reduce:
                    flat_grad.div_(self.world_size)
                collectives.reduce_scatter_in_buckets(
                    flat_grad,
                    region.grad_accumulator,
                    rank=self.rank,
                    world_size=self.world_size,
                    bucket_numel=self.reduce.bucket_size,
                    group=self.process_group,
                    scratch=self._reduced,
                )
            for param in region.params:
                param.grad = None
        self._has_gradients = True

    def step(
        self, step_index: int, *, loss_scale: float = 1.0, skip_overflow: bool = False
    ) -> StepOutcome:
        """Reduce, unscale, clip, update the master shards and gather the new weights.

        `step_index` (1-based) only names the step in errors. `loss_scale` is the factor the
        loss was multiplied by before backward (fp16); the gradients are divided by it.
        Returns the global gradient norm (unscaled, before clipping) as a 0-dim fp32 tensor
        on the device, and whether the step was taken; see [Note: host reads in a step].

        A non-finite gradient raises NonFiniteError, unless `skip_overflow` (fp16 loss
        scaling): then every rank skips the update and the gather together, drops the
        gradients and returns the non-finite norm ([Note: dynamic loss scale])."""
        if not self._has_gradients:
            raise RuntimeError(
                f"step {step_index}: no gradients were accumulated since the last step"
            )
        try:
            outcome = self._update(step_index, loss_scale, skip_overflow)
            if outcome.stepped:
                self.gather_weights(before_first_write=self._range_check(step_index))
        finally:
            # Whatever happened, this step's gradients are consumed: a NonFiniteError drops
            # them, so the next backward starts from clean accumulators.
            for region in self.regions:
                region.master.grad = None
                region.grad_accumulator.zero_()
            self._has_gradients = False
        return outcome

    def _update(self, step_index: int, loss_scale: float, skip_overflow: bool) -> StepOutcome:
        """Phases 1-3: reduce, check and clip the gradients, step the master shards."""
        shard_grads = [self._reduced_shard_grad(region, loss_scale) for region in self.regions]
        squares = torch.stack(
            [_sum_of_squares(grad, self.fused_norm) for grad in shard_grads]
        ).sum()
        # Reduced and rooted in float64, then rounded once to float32:
        # [Note: sharding-independent norm].
        total = collectives.all_reduce_sum(squares, self.world_size, self.process_group)
        grad_norm = total.sqrt().to(torch.float32)
        # The first of [Note: host reads in a step]. Every rank takes this branch together:
        # they all hold the same reduced norm.
        if not bool(torch.isfinite(grad_norm)):
            if skip_overflow:
                return StepOutcome(grad_norm, False)
            self._raise_non_finite(
                step_index,
                "gradient",
                shard_grads,
                f"norm {grad_norm.item()}",
                "the step was skipped and its gradients dropped: no weight, master shard or "
                "optimizer state changed",
            )
        if self.gradient_clipping > 0:
            clip_coef = torch.clamp(self.gradient_clipping / (grad_norm + 1e-6), max=1.0)
            for grad in shard_grads:
                grad.mul_(clip_coef)
        for region, grad in zip(self.regions, shard_grads, strict=True):
            region.master.grad = grad
        self.optimizer.step()
        return StepOutcome(grad_norm, True)

    def _range_check(self, step_index: int) -> Callable[[], None]:
        """Flag, on the device, updated masters that are not finite or would not survive the
        cast to the working dtype (inf, or above 65504 in fp16), all-reduced so every rank
        holds the same flag; return the check that reads it and raises, which the gather
        runs before it writes any working copy (the second of [Note: host reads in a
        step])."""
        masters = [region.master.detach() for region in self.regions]
        # The extremes are NaN if any element is, and beyond `limit` if an element is: one
        # pass, no temporary.
        limit = torch.finfo(self.dtype).max
        extremes = torch.stack([torch.stack(master.aminmax()) for master in masters]).abs()
        out_of_range = (~(extremes <= limit)).any().float()
        collectives.all_reduce_sum(out_of_range, self.world_size, self.process_group)

        def check_updated_masters() -> None:
            if bool(out_of_range > 0):
                self._raise_non_finite(
                    step_index,
                    "updated weight",
                    masters,
                    f"after the update, or beyond the {self.dtype} range of +-{limit:g}",
                    "no working copy was changed, but the fp32 master shards and the "
                    "optimizer state took this update and cannot be trusted: restore them "
                    "from a checkpoint",
                    limit=limit,
                )

        return check_updated_masters

    def gather_weights(
        self, before_first_write: Callable[[], None] | None = None
    ) -> dict[str, GatherStats]:
        """Phase 4: write every rank's master shard into every working copy (one gather
        for both regions, keyed by the region whose chunks carry it). `before_first_write`:
        run before any working copy is written; what it raises ends the gather."""
        main, exact = self.regions[-1], self._exact_region()
        world_size = self.world_size
        self.last_gather = {
            main.name: collectives.gather(
                self.gather_plan,
                main.master.detach(),
                main.working.view(world_size, -1),
                rank=self.rank,
                staging=self.staging,
                exact_source=None if exact is None else exact.master.detach(),
                exact_dest=None if exact is None else exact.working.view(world_size, -1),
                group=self.process_group,
                kernels=self.kernels,
                before_first_write=before_first_write,
            )
        }
        return self.last_gather

    @property
    def shard_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's master shards (the ``master`` tensors of
        :meth:`own_shards`); see [Note: own shards] (shards.py)."""
        return self.optimizer

    def own_shards(self) -> list[shards.OwnShard]:
        """This rank's shard of every region: master, working values, wire grouping, scales and
        parameter slots; see [Note: own shards] (shards.py)."""
        result = []
        for region in self.regions:
            start, end = region.shard_range(self.rank)
            ranges = [(slot.name, slot.offset, slot.numel) for slot in region.layout.slots]
            result.append(
                shards.make_own_shard(
                    region.name,
                    region.master,
                    region.working[start:end],
                    self.group_size if region.quantize else None,
                    None,
                    shards.slots_in_range(ranges, start, end),
                )
            )
        return result

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: a copy of each fp32 master shard, the layout it belongs
        to, and the torch optimizer's state (see [Note: checkpoint layout], checkpoint.py)."""
        if self._has_gradients:
            raise RuntimeError(
                "state_dict: gradients of an unfinished accumulation window are pending; "
                "take the optimizer step first (they are not part of a checkpoint)"
            )
        return {
            "regions": [
                {
                    "name": region.name,
                    "shard_numel": region.layout.shard_numel,
                    "slots": [[s.name, s.offset, s.numel] for s in region.layout.slots],
                    "master": region.master.detach().clone(),
                }
                for region in self.regions
            ],
            "torch_optimizer": self.optimizer.state_dict(),
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ValueError naming the first difference if `state` does not fit this
        optimizer's regions and torch optimizer; changes nothing."""
        saved = [(r["name"], r["shard_numel"], r["slots"]) for r in state["regions"]]
        here = [
            (r.name, r.layout.shard_numel, [[s.name, s.offset, s.numel] for s in r.layout.slots])
            for r in self.regions
        ]
        if [name for name, *_ in saved] != [name for name, *_ in here]:
            raise ValueError(
                f"regions {[n for n, *_ in saved]} in the state, {[n for n, *_ in here]} here"
            )
        for (name, numel, slots), (_, own_numel, own_slots) in zip(saved, here, strict=True):
            if numel != own_numel or slots != own_slots:
                raise ValueError(
                    f"region {name}: a shard of {numel} elements over parameters "
                    f"{[slot[0] for slot in slots]} in the state, {own_numel} over "
                    f"{[slot[0] for slot in own_slots]} here"
                )
        for region, entry in zip(self.regions, state["regions"], strict=True):
            master = entry["master"]
            if master.dtype != torch.float32 or master.shape != region.master.shape:
                raise ValueError(
                    f"region {region.name}: master {master.dtype} {tuple(master.shape)}, "
                    f"expected torch.float32 {tuple(region.master.shape)}"
                )
        torch_state = state["torch_optimizer"]
        groups = torch_state["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("torch optimizer: parameter groups differ from this optimizer's")
        numels = [master.numel() for master in self.master_shards().values()]
        for index, entry in torch_state["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() != numels[index]:
                    raise ValueError(
                        f"torch optimizer state {key} of parameter {index}: {value.numel()} "
                        f"elements, expected {numels[index]}"
                    )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the master shards and the torch optimizer state exactly, then re-gather
        every working copy from the masters ([Note: resume from the masters], checkpoint.py).
        Checks everything (:meth:`check_state_dict`) before changing anything."""
        self.check_state_dict(state)
        self.optimizer.load_state_dict(state["torch_optimizer"])
        with torch.no_grad():
            for region, entry in zip(self.regions, state["regions"], strict=True):
                region.master.copy_(entry["master"])
                region.grad_accumulator.zero_()
                region.master.grad = None
        self._has_gradients = False
        self.gather_weights()

    def master_shards(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 master shard of each region (read-only views)."""
        return {region.name: region.master.detach() for region in self.regions}

    # -------------------------------------------------------------- internals

    def _flatten_grads(self, region: Region, dtype: torch.dtype) -> torch.Tensor:
        """The region's gradients in one (padded_numel,) buffer of `dtype`, reused every
        step: the padding stays zero, a parameter without a gradient is zeroed."""
        key = (region.name, dtype)
        flat = self._flat_grads.get(key)
        if flat is None:
            flat = torch.zeros(region.layout.padded_numel, dtype=dtype, device=self.device)
            self._flat_grads[key] = flat
        for slot, param in zip(region.layout.slots, region.params, strict=True):
            if param.grad is None:
                flat[slot.offset : slot.end].zero_()
            else:
                flat[slot.offset : slot.end].copy_(param.grad.reshape(-1))
        return flat

    def _reduced_shard_grad(self, region: Region, loss_scale: float) -> torch.Tensor:
        """This rank's shard of the rank-averaged, unscaled gradient (fp32, shard_numel).

        One division, in fp32, by ``world_size * loss_scale`` (by the loss scale alone when
        the collective averaged already): for a power-of-two scale this rounds exactly as
        dividing by each in turn would."""
        if self.stage == 1:
            collectives.all_reduce_in_buckets(
                region.grad_accumulator,
                bucket_numel=self.reduce.bucket_size,
                world_size=self.world_size,
                group=self.process_group,
                reduce_dtype=self.reduce_dtype,
                divide_first=self._divide_before_reduce,
            )
            start, end = region.shard_range(self.rank)
            source = region.grad_accumulator[start:end]
        else:
            source = region.grad_accumulator
        shard = self._shard_grads.get(region.name)
        if shard is None:
            shard = torch.empty(source.numel(), dtype=torch.float32, device=self.device)
            self._shard_grads[region.name] = shard
        divisor = (1 if self._divide_before_reduce else self.world_size) * loss_scale
        if source.dtype != torch.float32:  # fp16 accumulators: unscale in fp32, not in fp16
            return shard.copy_(source).div_(divisor)
        return torch.div(source, divisor, out=shard)

    def _raise_non_finite(
        self,
        step_index: int,
        what: str,
        shards: list[torch.Tensor],
        detail: str,
        consequence: str,
        limit: float | None = None,
    ) -> None:
        """Gather the names of the affected parameters from every rank and raise on all: those
        with a non-finite element in `shards`, or one beyond `limit` in magnitude."""
        local: list[str] = []
        for region, shard in zip(self.regions, shards, strict=True):
            start, _ = region.shard_range(self.rank)
            mask = ~torch.isfinite(shard)
            if limit is not None:
                mask |= shard.abs() > limit
            bad = mask.nonzero().flatten().cpu() + start
            slots = region.layout.slots
            ends = torch.tensor([slot.end for slot in slots])
            owners = torch.searchsorted(ends, bad, right=True).unique()
            local += [slots[index].name for index in owners.tolist() if index < len(slots)]
        # Where did it come from? A non-finite working weight (say, written by the user)
        # poisons every gradient; name it so the error points at the cause.
        weights = [
            f"{slot.name} (rank {self.rank})"
            for region in self.regions
            for slot, param in zip(region.layout.slots, region.params, strict=True)
            if not bool(torch.isfinite(param.detach()).all())
        ]
        reports: list[tuple[list[str], list[str]]] = [(local, weights)]
        if self.world_size > 1:
            reports = [([], []) for _ in range(self.world_size)]
            dist.all_gather_object(reports, (local, weights), group=self.process_group)
        affected = sorted({name for names, _ in reports for name in names})
        bad_weights = sorted({name for _, names in reports for name in names})
        cause = f"; non-finite working weights: {', '.join(bad_weights)}" if bad_weights else ""
        error = NonFiniteError(
            f"step {step_index}: non-finite {what} ({detail}) in parameters: "
            f"{', '.join(affected) if affected else '(none found in the shards)'}{cause}; "
            f"{consequence}"
        )
        error.parameters = tuple(affected)
        error.what = what
        raise error
