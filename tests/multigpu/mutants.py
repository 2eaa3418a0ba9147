"""Broken candidates for the mutation suite, injected into the rank processes.

Each mutant is a ``RunPlan.arm_hook`` (``"tests.multigpu.mutants:NAME"``): the
runner calls it on every rank right after it builds a candidate arm, and it
breaks that arm the way a buggy implementation would -- through the torch
optimizer, the working copy, the master shards, the wire kernels or the config
-- or returns a replacement engine built wrong. ``KILLED_BY`` names the check
that must catch each one; ``test_qualify_mutants.py`` asserts it does.

A mutant may reach into an engine (it plays the part of a bug); the harness
never does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from qwz.qualify.run.subjects import make_arm

STALL_FROM_STEP = 5
"""Mutants that stop working part-way start failing at this step (> 1)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _after_each_step(engine, action) -> None:
    """Run `action(step)` after every training step of `engine` (1-based)."""
    original = engine.train_step
    counter = {"step": 0}

    @functools.wraps(original)
    def train_step(loss):
        original(loss)
        counter["step"] += 1
        action(counter["step"])

    engine.train_step = train_step


def _skip_optimizer_steps(engine, from_step: int, only_rank: int | None = None) -> None:
    optimizer = engine.shard_optimizer
    original = optimizer.step
    counter = {"calls": 0}

    def step(*args: Any, **kwargs: Any):
        counter["calls"] += 1
        if counter["calls"] >= from_step and only_rank in (None, _rank()):
            return None
        return original(*args, **kwargs)

    optimizer.step = step


# --------------------------------------------------------------------------- the optimizer


def weight_beyond_fp16(arm, engine, plan):
    """Not a broken gather: a model holding a weight of 1e5 -- within bf16's range, beyond
    fp16's (65,504) -- in a quantized parameter, on every rank's own shard. Under DeepSpeed's
    ZeRO++ scheme the fp16 staging makes it infinite and its group decodes to NaN, which the
    own-shard check names ([Note: DeepSpeed's ZeRO++ scheme]); under absmax/127 it is a weight
    like any other."""
    for shard in engine.own_shards():
        large = [slot for slot in shard.slots if slot.end - slot.start > 65_536]
        if large:
            with torch.no_grad():
                shard.master.view(-1)[large[0].start] = 1.0e5
                shard.working.view(-1)[large[0].start] = 1.0e5
            return None
    return None


def never_updates(arm, engine, plan):
    """The learning rate is 0: the masters only decay."""
    for group in engine.shard_optimizer.param_groups:
        group["lr"] = 0.0


def gradient_sign_flipped(arm, engine, plan):
    """Gradient ascent: the optimizer is handed the negated gradient (consistently, so the
    update check, which uses the gradient the optimizer saw, cannot see it)."""

    def negate(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.neg_()

    engine.shard_optimizer.register_step_pre_hook(negate)


def stalls_from_step_k(arm, engine, plan):
    """From step STALL_FROM_STEP on, the optimizer silently does not step, on every rank."""
    _skip_optimizer_steps(engine, STALL_FROM_STEP)


def one_rank_stalls_from_step_k(arm, engine, plan):
    """From step STALL_FROM_STEP on, rank 1's shard is no longer stepped."""
    _skip_optimizer_steps(engine, STALL_FROM_STEP, only_rank=1)


def lr_times_world_size(arm, engine, plan):
    """The learning rate scaled by the world size (a classic data-parallel bug)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    for group in engine.shard_optimizer.param_groups:
        group["lr"] = group["lr"] * world


def weight_decay_dropped(arm, engine, plan):
    """The config's weight decay is not passed on."""
    for group in engine.shard_optimizer.param_groups:
        group["weight_decay"] = 0.0


# --------------------------------------------------------------------------- the gather


def owner_keeps_exact_shard(arm, engine, plan):
    """The owner keeps its freshly stepped shard (cast, not decoded) in its own working copy,
    while the other ranks decode: replicas drift apart."""

    def keep(step):
        with torch.no_grad():
            for shard in engine.own_shards():
                if shard.group_size is not None:
                    shard.working.copy_(shard.master.detach().to(shard.working.dtype))

    _after_each_step(engine, keep)


def master_overwritten_with_decoded(arm, engine, plan):
    """Every rank overwrites its fp32 master with the decoded working values, so the
    quantization error accumulates in the optimizer's state."""

    def overwrite(step):
        with torch.no_grad():
            for shard in engine.own_shards():
                if shard.group_size is not None:
                    shard.master.detach().copy_(shard.working.float())

    _after_each_step(engine, overwrite)


def one_chunk_skipped(arm, engine, plan):
    """One chunk of the gather never arrives: the first quarter of the largest parameter keeps
    the previous step's values on every rank."""
    largest = max(engine.module.parameters(), key=lambda param: param.numel())
    flat = largest.detach().view(-1)
    chunk = slice(0, flat.numel() // 4)
    before = {"values": flat[chunk].clone()}
    original = engine.train_step

    def train_step(loss):
        before["values"] = flat[chunk].clone()
        original(loss)
        with torch.no_grad():
            flat[chunk].copy_(before["values"])

    engine.train_step = train_step


def _encode_with(engine, scale_of, prepare=None) -> None:
    """Replace the candidate's encode kernel with one written from the PR's text: per group
    of the wire row, ``scale = scale_of(absmax)`` (fp32), codes ``round(x / scale)`` clamped
    to [-127, 127], of the values `prepare` returns (the fp32 source by default). Groups that
    share elements with exactly-sent parameters keep qwz's own masked path."""
    from qwz import kernels as wire_kernels
    from qwz import quant

    def encode(values, scales_out, codes_out):
        if prepare is not None:
            values = prepare(values)
        padding = codes_out.shape[0] - values.shape[0]
        groups = torch.nn.functional.pad(values.to(torch.float32), (0, padding))
        groups = groups.view(scales_out.shape[0], -1)
        absmax = groups.abs().amax(dim=1)
        scales = torch.where(absmax == 0, absmax, scale_of(absmax))
        divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
        codes = torch.round(groups / divisor[:, None]).clamp_(-127, 127)
        scales_out.copy_(scales)
        codes_out.copy_(codes.to(torch.int8).view(-1))

    kernels = wire_kernels.QuantKernels("eager", encode, quant.decode_into)
    optimizer = engine.optimizer
    if hasattr(optimizer, "qwz"):  # the DeepSpeed drop-in: [Note: drop-in state]
        optimizer.qwz.kernels = kernels
    else:
        optimizer.kernels = kernels


def scale_absmax_over_128(arm, engine, plan):
    """The upstream bug: the scale maps absmax to 128, then the codes are clamped to 127."""
    _encode_with(engine, lambda absmax: absmax / 128)


# ------------------------------------------------------------ when the decode completes


def _decode_deferred(engine, completes: bool) -> None:
    """After each step the working copy goes back to what it held before the step (the
    decode has not landed yet); the decoded values are written by a forward pre-hook of the
    model just before its next forward -- or, when not `completes`, never."""
    module = engine.module
    params = list(module.parameters())
    original = engine.train_step
    pending: dict[str, list[torch.Tensor]] = {}

    def train_step(loss):
        before = [param.detach().clone() for param in params]
        original(loss)
        with torch.no_grad():
            pending["decoded"] = [param.detach().clone() for param in params]
            for param, value in zip(params, before, strict=True):
                param.copy_(value)

    def finish_decode(module, args):
        decoded = pending.pop("decoded", None)
        if decoded is not None and completes:
            with torch.no_grad():
                for param, value in zip(params, decoded, strict=True):
                    param.copy_(value)

    engine.train_step = train_step
    module.register_forward_pre_hook(finish_decode)


def decode_never_completes(arm, engine, plan):
    """The decode is deferred to the next forward and never lands: the working copy keeps
    the weights as built."""
    _decode_deferred(engine, completes=False)


# --------------------------------------------------------------------------- the config


def _rebuilt(arm, plan, edit_zero, reported_group_size=None):
    config = copy.deepcopy(plan.arm_config(arm))
    edit_zero(config["zero_optimization"])
    engine = make_arm(
        plan.subject,
        plan.workload.build_model(plan.seed),
        config,
        quantized=True,
        fused_kernels=plan.kernels == "fused",
        qwz_gather=plan.qwz_gather,
    )
    if reported_group_size is not None:
        engine.group_size = reported_group_size
    return engine


def wire_8192_reports_64(arm, engine, plan):
    """Quantizes with groups of 8192 while the engine reports the requested 64."""
    return _rebuilt(
        arm,
        plan,
        lambda zero: zero.update(zero_quantized_weights_group_size=8192),
        reported_group_size=arm.group_size,
    )


def small_parameters_quantized(arm, engine, plan):
    """Parameters of at most 65,536 elements (norms, biases) are quantized too."""
    return _rebuilt(arm, plan, lambda zero: zero.update(zero_quantized_weights_preserve_numel=0))


# ------------------------------------------------- the staging bound and the chunk edges
#
# Wrong only where a gather chunks: the qualification's chunked arm ([Note: the chunked arm],
# qwz/qualify/run/chunked_arm.py) is where the default qualification sees them; the candidate
# with the run's own bucket (one chunk on these workloads) runs the same code and passes.

UNBOUNDED_BUCKET = 1 << 40
"""bucket_ignored: the bucket the engine is built with instead of the arm's."""


def bucket_ignored(arm, engine, plan):
    """The gather ignores ``allgather_bucket_size``: the arm is built as the runner builds it
    but for a bucket that holds everything, so each rank's whole partition travels in one
    collective (the same weights, the same reductions: only the staging differs)."""
    from qwz.qualify.run import arm_run

    unbounded = dataclasses.replace(arm, allgather_bucket_size=UNBOUNDED_BUCKET)
    return arm_run.build(dataclasses.replace(plan, arm_hook=None), unbounded)


def _chunk_edges(engine) -> list[tuple[torch.Tensor, list[int]]]:
    """Per gather, the (W, P) view of the working buffer it writes and the first element of
    every chunk after the first: qwz's engine (one plan) or the DeepSpeed drop-in (a plan per
    flat group, [Note: drop-in state])."""
    optimizer = engine.optimizer
    state = getattr(optimizer, "qwz", None)
    if state is None:  # qwz's engine: the quantized region is the main stream
        main = optimizer.regions[-1]
        gathers = [(main.working.view(optimizer.world_size, -1), optimizer.gather_plan)]
    else:
        gathers = [
            (flat.view(plan.world_size, plan.partition_numel), plan.gather_plan)
            for plan, flat in zip(state.plans, optimizer.bit16_groups_flat, strict=True)
            if plan.world_size > 1
        ]
    return [(dest, [chunk.start for chunk in gather.chunks[1:]]) for dest, gather in gathers]


def stale_chunk_edge(arm, engine, plan):
    """The first element of every chunk after the first is never written: on every rank, every
    source's element there keeps the previous step's value (the replicas still agree)."""
    edges = _chunk_edges(engine)
    original = engine.train_step

    def train_step(loss):
        before = [dest[:, starts].clone() for dest, starts in edges]
        original(loss)
        with torch.no_grad():
            for (dest, starts), values in zip(edges, before, strict=True):
                dest[:, starts] = values

    engine.train_step = train_step


def groups_restart_at_chunk_edge(arm, engine, plan):
    """qwz's engine with chunks cut half a group short of whole groups (its bucket counted in
    elements, not rounded to groups): each chunk's groups restart at its first element, which
    is no group edge of the partition."""
    from qwz import layout
    from qwz.quant import WireRow

    optimizer = engine.optimizer
    gather = optimizer.gather_plan
    half = optimizer.group_size // 2
    starts = [0] + [chunk.start - half for chunk in gather.chunks[1:]]
    ends = [*starts[1:], gather.chunks[-1].end]
    chunks = tuple(
        layout.GatherChunk(
            start,
            end,
            WireRow(-(-(end - start) // chunk.row.group_size), chunk.row.group_size,
                    chunk.row.exact_numel, chunk.row.element_size),
            chunk.pieces,
        )
        for start, end, chunk in zip(starts, ends, gather.chunks, strict=True)
    )  # fmt: skip
    optimizer.gather_plan = dataclasses.replace(gather, chunks=chunks)
    optimizer.staging.reserve(optimizer.gather_plan)


CHUNKED_KILLED_BY = {
    "bucket_ignored": "bounded",
    "stale_chunk_edge": "own-shard",
    "groups_restart_at_chunk_edge": "own-shard",
}
"""Mutants wrong only where a gather chunks -> the family of the check that must fail on the
chunked arm, in the default qualification (the run's own bucket: one chunk)."""


# --------------------------------------------------------------------------- the spec itself
#
# [Note: spec mutants]
# A commit that changes the spec inside qwz -- the scale formula, the rounding, the exactness
# threshold -- changes every path that computes it together: the kernels, the engine's
# own-shard scales (qwz/shards.py), the tolerance (qwz/qualify/evidence/tolerance.py). These mutants
# patch the one definition in qwz (``qwz.quant`` / ``qwz.config``), rebuild the candidate under the
# patch, and keep it until the engine is collected (the next arm and the next test see the
# original; qwz's cached kernel choice is cleared both ways). The native C kernels cannot be
# patched from Python, so the candidate runs the eager kernels, which the patch reaches;
# ``*_native_disagrees`` instead keeps the fused kernels: the native kernels' probe then sees
# that they no longer write the eager kernels' bytes and qwz falls back to torch.compile of
# the patched code -- the record's ``kernels`` must say so.

ABSMAX_DIVISOR_MUTANT = 100
"""The scale formula of the scale mutant: absmax / 100 instead of / 127."""
THRESHOLD_MUTANTS = {"spec_exact_threshold_4096": 4_096, "spec_exact_threshold_1m": 1 << 20}
"""The exactness threshold of the threshold mutants instead of 65,536."""
PLAN_WORKLOADS = {"spec_exact_threshold_4096": {"sizes": [263, 1031, 63, 3], "micro_batch": 8}}
"""mlp sizes a mutant needs to be observable: the default mlp has no parameter of 4,097 to
65,536 elements, so a 4,096 threshold changes nothing there (1031 x 63 = 64,953 does)."""


def _scale_over_100(absmax):
    """``quant.scale_from_absmax`` with the mutated formula (everything else as qwz's)."""
    absmax = absmax.to(torch.float32)
    return torch.where(
        absmax == 0,
        absmax,
        torch.clamp(absmax / ABSMAX_DIVISOR_MUTANT, min=torch.finfo(torch.float32).tiny),
    )


def _codes_floor(values, inverse):
    """``quant._codes`` rounding down instead of to nearest."""
    codes = torch.floor(values * inverse[:, None])
    codes = torch.where(codes == codes, codes, torch.zeros_like(codes))
    return codes.clamp_(-127, 127).to(torch.int8)


_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _clear_kernel_choice() -> None:
    from qwz import kernels

    for cached in (kernels.native_kernels, kernels.self_test_on, kernels.fused_kernels):
        cached.cache_clear()


def _restore_spec() -> None:
    for (module, name), original in _ORIGINALS.items():
        setattr(module, name, original)
    if _ORIGINALS:
        _ORIGINALS.clear()
        _clear_kernel_choice()


def _spec_patched(arm, plan, patches, *, fused_kernels=False):
    """The candidate rebuilt with `patches` ((module, name, value), ...) in force until the
    engine is collected ([Note: spec mutants])."""
    _restore_spec()
    for module, name, value in patches:
        _ORIGINALS[(module, name)] = getattr(module, name)
        setattr(module, name, value)
    _clear_kernel_choice()
    engine = make_arm(
        plan.subject,
        plan.workload.build_model(plan.seed),
        copy.deepcopy(plan.arm_config(arm)),
        quantized=True,
        fused_kernels=fused_kernels,
        qwz_gather=plan.qwz_gather,
    )
    weakref.finalize(engine, _restore_spec)
    return engine


def spec_scale_absmax_over_100(arm, engine, plan):
    """The scale formula changed in qwz itself: absmax / 100 (eager kernels)."""
    from qwz import quant

    return _spec_patched(arm, plan, [(quant, "scale_from_absmax", _scale_over_100)])


def spec_scale_absmax_over_100_native_disagrees(arm, engine, plan):
    """The same change with the fused kernels asked for: the native C kernels keep /127, so
    their probe fails and torch.compile of the patched code runs instead."""
    from qwz import quant

    return _spec_patched(
        arm, plan, [(quant, "scale_from_absmax", _scale_over_100)], fused_kernels=True
    )


def spec_rounding_floor(arm, engine, plan):
    """The rounding changed in qwz itself: codes rounded down (eager kernels)."""
    from qwz import quant

    return _spec_patched(arm, plan, [(quant, "_codes", _codes_floor)])


def _threshold(name):
    def mutant(arm, engine, plan):
        from qwz import config

        return _spec_patched(
            arm, plan, [(config, "DEFAULT_PRESERVE_NUMEL", THRESHOLD_MUTANTS[name])]
        )

    mutant.__name__ = name
    mutant.__doc__ = f"The exactness threshold changed in qwz itself: {THRESHOLD_MUTANTS[name]:,}."
    return mutant


spec_exact_threshold_4096 = _threshold("spec_exact_threshold_4096")
spec_exact_threshold_1m = _threshold("spec_exact_threshold_1m")


# --------------------------------------------------------------------------- the global norm

WRONG_NORM_FACTOR = 2.2121 / 2.9729
"""The wrong global norm measured with compiled kernels reused across CPU capabilities."""


def clip_coefficient_scaled(arm, engine, plan):
    """The optimizer is handed the clipped gradient scaled by 0.8 (a wrong clip coefficient;
    the update check, which uses the gradient the optimizer saw, cannot see it)."""

    def scale(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(0.8)

    engine.shard_optimizer.register_step_pre_hook(scale)


def wrong_global_norm(arm, engine, plan):
    """qwz's engine computes the global norm 2.2121/2.9729 of its value, reports it and clips
    with it (the wrong sum of squares of kernels compiled under another CPU capability)."""
    from qwz import optimizer as module

    original_squares, original_step = module._sum_of_squares, engine.train_step

    def wrong_squares(values, fused):
        return original_squares(values, fused) * WRONG_NORM_FACTOR**2

    def train_step(loss):
        module._sum_of_squares = wrong_squares
        try:
            original_step(loss)
        finally:
            module._sum_of_squares = original_squares

    engine.train_step = train_step


# --------------------------------------------------------------------------- MoE (moe-tiny)


def _expert_parameters(engine, plan) -> list[tuple[str, torch.nn.Parameter]]:
    keys = plan.workload.replica_keys(engine.module)
    return [(name, p) for name, p in engine.module.named_parameters() if keys[name] != "dense"]


def expert_gather_stale(arm, engine, plan):
    """The expert-data-parallel groups' gather never arrives: every expert parameter keeps the
    previous step's working values on every rank, while the dense gather is correct."""
    experts = [param for _, param in _expert_parameters(engine, plan)]
    original = engine.train_step

    def train_step(loss):
        before = [param.detach().clone() for param in experts]
        original(loss)
        with torch.no_grad():
            for param, value in zip(experts, before, strict=True):
                param.copy_(value)

    engine.train_step = train_step


def expert_update_skipped(arm, engine, plan):
    """The experts' param group is never stepped; the dense group is (DeepSpeed steps its
    torch optimizer once per param group)."""
    optimizer = engine.shard_optimizer
    original = optimizer.step

    def step(*args: Any, **kwargs: Any):
        if any(group.get("moe") for group in optimizer.param_groups):
            return None
        return original(*args, **kwargs)

    optimizer.step = step


def expert_replica_drifts_on_last_rank(arm, engine, plan):
    """After every step the last rank nudges element 0 of its first local expert's weight --
    outside its own shard at world size 4, where that element belongs to its peer in the
    expert-data-parallel group -- so only a comparison of the ranks holding that expert sees
    it."""
    _, weight = _expert_parameters(engine, plan)[0]
    world = dist.get_world_size() if dist.is_initialized() else 1

    def nudge(step):
        if _rank() == world - 1:
            with torch.no_grad():
                flat = weight.view(-1)
                flat[0] = flat[0] + 0.5

    _after_each_step(engine, nudge)


MOE_KILLED_BY = {
    "expert_gather_stale": "own-shard",
    "expert_update_skipped": "update",
    "expert_replica_drifts_on_last_rank": "replicas",
}
"""The MoE mutants (the ``moe-tiny`` workload through the deepspeed subject, world size 4)
-> the family of the check that must fail."""


KILLED_BY = {
    "never_updates": "update",
    "gradient_sign_flipped": "step1-exact",
    "stalls_from_step_k": "update",
    "one_rank_stalls_from_step_k": "update",
    "lr_times_world_size": "update",
    "weight_decay_dropped": "update",
    "owner_keeps_exact_shard": "replicas",
    "master_overwritten_with_decoded": "update",
    "one_chunk_skipped": "own-shard",
    "scale_absmax_over_128": "own-shard",
    "wire_8192_reports_64": "own-shard",
    "small_parameters_quantized": "own-shard",
    "spec_scale_absmax_over_100": "own-shard",
    "spec_scale_absmax_over_100_native_disagrees": "own-shard",
    "spec_rounding_floor": "own-shard",
    "spec_exact_threshold_4096": "own-shard",
    "spec_exact_threshold_1m": "own-shard",
    "clip_coefficient_scaled": "update",
    "wrong_global_norm": "update",
    "decode_never_completes": "own-shard",
}
"""Mutant -> the family of the check that must fail (``<family>[<candidate arm>]``)."""


# --------------------------------------------------------------------------- correct variants
#
# Candidates that use a freedom of [Note: the contract and its freedoms]
# (qwz/qualify/evidence/spec.py) and so must PASS, written from the PR's text.


def quantizes_working_cast(arm, engine, plan):
    """Freedom 1: quantizes the master cast to the working dtype (what a PR that quantizes
    inside DeepSpeed's gather of the bf16 partition does), not the fp32 master."""
    from qwz.optimizer import WORKING_DTYPES

    working = WORKING_DTYPES[plan.dtype]
    _encode_with(engine, lambda absmax: absmax / 127, prepare=lambda values: values.to(working))


RECIPROCAL_127 = torch.tensor(1 / 127, dtype=torch.float32)
"""fp32 1/127: ``absmax * (1/127)`` is ``absmax/127`` or one of its fp32 neighbours."""


def scale_times_reciprocal(arm, engine, plan):
    """Freedom 2: the scale as ``absmax * (1/127)`` in fp32 (one ulp from absmax/127 in a
    few percent of groups), at least the smallest normal float32."""
    _encode_with(
        engine,
        lambda absmax: torch.clamp(absmax * RECIPROCAL_127, min=torch.finfo(torch.float32).tiny),
    )


def decode_completes_late(arm, engine, plan):
    """Freedom 4: the decode lands just before the next forward, not when ``step()``
    returns (the overlap DeepSpeed issue #6876 asks for)."""
    _decode_deferred(engine, completes=True)


def gather_runs_at_next_forward(arm, engine, plan):
    """Freedom 4, the whole gather: ``step()`` updates the masters only; the quantized gather
    -- its collectives included -- runs in a forward pre-hook of the model, just before the
    weights are next used (the probe must count it: [Note: the wire window])."""
    optimizer = engine.optimizer
    target = getattr(optimizer, "qwz", optimizer)  # the drop-in: [Note: drop-in state]
    gather = target.gather_weights
    pending = {"gather": False, "check": None}

    def deferred(before_first_write=None):
        pending.update(gather=True, check=before_first_write)
        return target.last_gather

    def finish_gather(module, args):
        if pending["gather"]:
            pending["gather"] = False
            gather(before_first_write=pending["check"])

    target.gather_weights = deferred
    engine.module.register_forward_pre_hook(finish_gather)


CORRECT_VARIANTS = (
    "quantizes_working_cast",
    "scale_times_reciprocal",
    "decode_completes_late",
    "gather_runs_at_next_forward",
)
"""Correct candidates, each using a freedom of the contract: each must PASS."""


# --------------------------------------------------------------------------- fp16 loss scaling


def _skipped_steps(engine) -> int:
    """The engine's count of overflow-skipped steps (qwz's engine and DeepSpeed's alike)."""
    return int(engine.engine.skipped_steps)


def gather_skipped_after_overflow(arm, engine, plan):
    """fp16: a stale overflow flag -- the first step taken after an overflow-skipped step
    updates the masters but skips the weight gather, so the working weights stay those of
    before the step on every rank (consistently: the replicas agree)."""
    original = engine.train_step
    state = {"after_skip": False}

    def train_step(loss):
        skipped_before = _skipped_steps(engine)
        stale = [param.detach().clone() for param in engine.module.parameters()]
        original(loss)
        skipped = _skipped_steps(engine) > skipped_before
        if state["after_skip"] and not skipped:
            with torch.no_grad():
                for param, old in zip(engine.module.parameters(), stale, strict=True):
                    param.copy_(old)
        state["after_skip"] = skipped

    engine.train_step = train_step


def skipped_step_counted(arm, engine, plan):
    """fp16: an overflow-skipped step advances Adam's step count (its bias correction then
    runs one step ahead), though the masters and moments are left alone."""
    original = engine.train_step

    def train_step(loss):
        skipped_before = _skipped_steps(engine)
        original(loss)
        if _skipped_steps(engine) > skipped_before:
            for state in engine.shard_optimizer.state.values():
                if "step" in state:
                    state["step"] += 1

    engine.train_step = train_step


def _scaler(engine):
    """(the engine's loss scaler, its scale attribute, its window attribute)."""
    from qwz.loss_scale import LossScaler

    inner = engine.engine
    if isinstance(getattr(inner, "loss_scaler", None), LossScaler):  # qwz's engine
        return inner.loss_scaler, "scale", "window"
    return inner.optimizer.loss_scaler, "cur_scale", "scale_window"  # DeepSpeed's


SCALE_START_DIVISOR = 16
"""scaler_starts_lower: the candidate's scale starts this many times below the config's."""


def scaler_starts_lower(arm, engine, plan):
    """fp16: the candidate's loss scale starts 16x below 2**initial_scale_power."""
    scaler, scale, _ = _scaler(engine)
    setattr(scaler, scale, getattr(scaler, scale) / SCALE_START_DIVISOR)


def scaler_never_grows(arm, engine, plan):
    """fp16: the candidate's loss scale never doubles (its window is never reached)."""
    scaler, _, window = _scaler(engine)
    setattr(scaler, window, 1 << 30)


FP16_KILLED_BY = {
    "gather_skipped_after_overflow": "own-shard",
    "scaler_starts_lower": "overflow-pattern",
    "scaler_never_grows": "overflow-pattern",
    "skipped_step_counted": "update",
}
"""fp16 mutants (they change nothing without an overflow, so they run with --dtype fp16;
tests/multigpu/test_qualify_fp16.py) -> the family of the check that must fail."""
