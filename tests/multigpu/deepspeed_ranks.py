"""Rank-side functions for the DeepSpeed integration tests (run on every rank by LocalWorld).

Each function builds the tiny ``DeepSpeedLayoutMLP`` (tests/multigpu/models.py)
from a seed, trains it with DeepSpeed (through
``qwz.integrations.deepspeed.initialize`` or plain ``deepspeed.initialize``) and
returns plain data -- losses, hashes, byte counts, bound violations -- for the
test process to assert on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.integrations import deepspeed as qwz_deepspeed
from qwz.integrations.deepspeed.state import state_of
from qwz.qualify.evidence.spec import half_ulp
from qwz.qualify.evidence.tolerance import element_bound
from tests.multigpu.models import MICRO_BATCH, batch, build_deepspeed_layout_mlp, device_of
from tests.multigpu.ranks import BETAS, LR
from tests.multigpu.scales import element_scales

WEIGHT_DECAY = 0.01
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def ds_config(
    *,
    stage: int,
    dtype: str = "bf16",
    quantized: bool = True,
    group_size: int | None = None,
    bucket: float = 5e8,
    preserve: int | None = None,
    initial_scale_power: int = 16,
) -> dict[str, Any]:
    """A DeepSpeed config; fp16 uses dynamic loss scaling from 2**initial_scale_power."""
    zero: dict[str, Any] = {
        "stage": stage,
        "allgather_bucket_size": bucket,
        "reduce_bucket_size": 5e8,
    }
    if quantized:
        zero["zero_quantized_weights"] = True
    if group_size is not None:
        zero["zero_quantized_weights_group_size"] = group_size
    if preserve is not None:
        zero["zero_quantized_weights_preserve_numel"] = preserve
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": initial_scale_power},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": 1e-8,
                "weight_decay": WEIGHT_DECAY,
                "torch_adam": True,  # torch.optim.AdamW: no JIT-built op, same math as qwz
            },
        },
    }


def _quiet() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def _build(config: dict[str, Any], seed: int, *, plain: bool = False, **kwargs: Any) -> Any:
    _quiet()
    model = build_deepspeed_layout_mlp(seed)
    if plain:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    else:
        engine, *_ = qwz_deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, **kwargs
        )
    return engine


def _forward_backward(engine: Any, seed: int, step: int) -> float:
    dtype = next(engine.module.parameters()).dtype
    inputs, targets = batch(seed, step, dist.get_rank(), dtype, device_of(engine.module))
    loss = torch.nn.functional.mse_loss(engine(inputs).float(), targets)
    engine.backward(loss)
    return loss.item()


def _exact_mask(engine: Any, group: int, rank: int) -> torch.Tensor:
    """(P,) bool: which elements of `rank`'s partition belong to parameters of at most
    preserve_numel elements. Found from where the module's parameters point into the flat
    buffer, independently of qwz's own plan."""
    optimizer = engine.optimizer
    flat = optimizer.bit16_groups_flat[group]
    partition_numel = optimizer.parallel_partitioned_bit16_groups[group][rank].numel()
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    for param in engine.module.parameters():
        offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
        inside = 0 <= offset < flat.numel()
        if inside and param.numel() <= optimizer.qwz.preserve_numel:
            mask[offset : offset + param.numel()] = True
    return mask[rank * partition_numel : (rank + 1) * partition_numel]


def _own_partition_expected(engine: Any, group: int) -> torch.Tensor:
    """This rank's partition as qwz's gather must leave it, computed independently with
    qwz.quantize: the master zero-padded to whole groups, small-parameter elements zeroed
    and then sent exactly, decoded and cast to the working dtype."""
    optimizer = engine.optimizer
    flat = optimizer.bit16_groups_flat[group]
    master = optimizer.single_partition_of_fp32_groups[group].detach()
    exact = _exact_mask(engine, group, dist.get_rank())
    source = torch.where(exact, torch.zeros_like(master), master)
    decoded = qwz.dequantize(qwz.quantize(source, optimizer.quantization_group_size), flat.dtype)
    return torch.where(exact, master.to(flat.dtype), decoded)


def train(
    config: dict[str, Any],
    steps: int,
    seed: int = 0,
    *,
    qwz_gather: bool | None = None,
    check_decode: bool = True,
) -> dict[str, Any]:
    """Train `steps` steps; per step record the loss, grad norm, hash and the wire check."""
    engine = _build(config, seed, qwz_gather=qwz_gather)
    optimizer = engine.optimizer
    result: dict[str, Any] = {
        "losses": [],
        "grad_norms": [],
        "hashes": [],
        "checks": [],
        "reported_stats": [],
        "decode_matches": [],
        "group_size": getattr(optimizer, "quantization_group_size", "missing"),
        "optimizer": type(optimizer).__name__,
        "partition_numels": [
            partitions[0].numel() for partitions in optimizer.parallel_partitioned_bit16_groups
        ],
        "working_dtype": str(optimizer.bit16_groups_flat[0].dtype),
        "allgather_bucket_size": optimizer.allgather_bucket_size,
    }
    for step in range(1, steps + 1):
        result["losses"].append(_forward_backward(engine, seed, step))
        check = qwz_deepspeed.measure_weight_gather(engine)
        result["checks"].append({**check._asdict(), "in_effect": check.in_effect})
        result["grad_norms"].append(float(engine.get_global_grad_norm()))
        result["hashes"].append(qwz.param_hash(engine.module))
        state = state_of(optimizer)
        stats = None if state is None else state.gather_stats
        result["reported_stats"].append(None if stats is None else stats._asdict())
        if check_decode and state is not None and state.taken_over:
            rank = dist.get_rank(group=optimizer.real_dp_process_group[0])
            result["decode_matches"].append(
                all(
                    torch.equal(
                        optimizer.parallel_partitioned_bit16_groups[i][rank],
                        _own_partition_expected(engine, i),
                    )
                    for i in range(len(optimizer.bit16_groups_flat))
                )
            )
    state = state_of(optimizer)
    plans = state.plans if state is not None and state.taken_over else []
    result["exact_counts"] = [
        [positions.numel() for positions in plan.exact_positions] for plan in plans
    ]
    return result


def compare_with_stock(
    stage: int, dtype: str, steps: int, group_size: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Stock DeepSpeed and DeepSpeed + qwz side by side from identical weights and data.

    Each rank compares every element of its own partition of the flat buffer (replicas
    are identical, so together the ranks cover the whole model) against
    ``qwz.qualify.evidence.tolerance.element_bound``; after step 1, where both masters are still
    equal, also against the tighter ``scale / 2 + two half-ulps``.
    """
    stock = _build(ds_config(stage=stage, dtype=dtype, quantized=False), seed, plain=True)
    candidate = _build(ds_config(stage=stage, dtype=dtype, group_size=group_size), seed)
    working_dtype = DTYPES[dtype]
    rank = dist.get_rank()
    violations = checked = step1_violations = 0
    worst_ratio = 0.0
    max_error = 0.0
    exact_equal_after_step1 = masters_equal_after_step1 = None
    for step in range(1, steps + 1):
        for engine in (stock, candidate):
            _forward_backward(engine, seed, step)
            engine.step()
        stock_params = dict(stock.module.named_parameters())
        for i in range(len(candidate.optimizer.qwz.plans)):
            reference = stock.optimizer.parallel_partitioned_bit16_groups[i][rank].float()
            values = candidate.optimizer.parallel_partitioned_bit16_groups[i][rank].float()
            scales = _element_scales(candidate, i)
            error = (values - reference).abs()
            bound = element_bound(step, LR, BETAS, scales, reference, values, working_dtype)
            violations += int((error > bound).sum())
            checked += error.numel()
            worst_ratio = max(worst_ratio, float((error / bound).max()))
            max_error = max(max_error, float(error.max()))
            if step == 1:
                tight = (
                    scales / 2
                    + half_ulp(reference, working_dtype)
                    + half_ulp(values, working_dtype)
                )
                step1_violations += int((error > tight).sum())
                # Small parameters travel exactly: bit-identical to stock while masters agree.
                exact_equal_after_step1 = all(
                    torch.equal(param, stock_params[name])
                    for name, param in candidate.module.named_parameters()
                    if param.numel() <= candidate.optimizer.qwz.preserve_numel
                )
                masters_equal_after_step1 = bool(
                    torch.equal(
                        stock.optimizer.single_partition_of_fp32_groups[i],
                        candidate.optimizer.single_partition_of_fp32_groups[i],
                    )
                )
    return {
        "violations": violations,
        "step1_violations": step1_violations,
        "checked": checked,
        "worst_ratio": worst_ratio,
        "max_error": max_error,
        "exact_equal_after_step1": exact_equal_after_step1,
        "masters_equal_after_step1": masters_equal_after_step1,
        "final_hashes": (qwz.param_hash(stock.module), qwz.param_hash(candidate.module)),
    }


def _element_scales(engine: Any, group: int) -> torch.Tensor:
    """(P,) fp32: the quantization scale behind each element of this rank's partition
    (0 for elements of small parameters, which travel exactly)."""
    optimizer = engine.optimizer
    master = optimizer.single_partition_of_fp32_groups[group].detach().float()
    group_size = optimizer.quantization_group_size
    exact = _exact_mask(engine, group, dist.get_rank())
    source = torch.where(exact, torch.zeros_like(master), master)
    scales = qwz.quantize(source, group_size).scales
    per_element = scales.repeat_interleave(group_size)[: master.numel()]
    return torch.where(exact, torch.zeros_like(per_element), per_element)


def plain_engine_stays_stock(steps: int = 2) -> dict[str, Any]:
    """A qwz engine and a plain deepspeed.initialize engine in one process, interleaved."""
    from deepspeed.runtime.zero import stage_1_and_2

    module_gather = stage_1_and_2.all_gather_dp_groups
    candidate = _build(ds_config(stage=2, group_size=64), seed=0)
    plain = _build(ds_config(stage=2, quantized=False), seed=0, plain=True)
    checks: dict[str, list[dict[str, Any]]] = {"qwz": [], "plain": []}
    for step in range(1, steps + 1):
        for name, engine in (("qwz", candidate), ("plain", plain)):
            _forward_backward(engine, 0, step)
            check = qwz_deepspeed.measure_weight_gather(engine)
            checks[name].append({**check._asdict(), "in_effect": check.in_effect})
    return {
        "checks": checks,
        "module_gather_restored": stage_1_and_2.all_gather_dp_groups is module_gather,
        "plain_step_is_class_step": "step" not in vars(plain.optimizer),
        "qwz_step_is_replaced": "step" in vars(candidate.optimizer),
        "plain_has_no_group_size": not hasattr(plain.optimizer, "quantization_group_size"),
    }


def probe_sees_stock_gather(steps: int = 1) -> dict[str, int]:
    """What WireProbe sees of a stock DeepSpeed step: DeepSpeed cached torch's gather at
    init, so this checks [Note: wire accounting below every entry point]
    (qwz/integrations/probe.py)."""
    from qwz.integrations.probe import WireProbe

    plain = _build(ds_config(stage=2, quantized=False), seed=0, plain=True)
    _forward_backward(plain, 0, 1)
    with WireProbe() as probe:
        plain.step()
    return {
        "seen": probe.bytes["gather"],
        "unquantized": qwz_deepspeed.unquantized_gather_bytes(plain.optimizer),
    }


def refresh_through_update_lp_params(steps: int = 2) -> dict[str, Any]:
    """update_lp_params (DeepSpeed's refresh after a universal-checkpoint load) also
    gathers through qwz and, the masters being unchanged, rewrites the same values."""
    engine = _build(ds_config(stage=2, group_size=64), seed=0)
    for step in range(1, steps + 1):
        _forward_backward(engine, 0, step)
        engine.step()
    before = (qwz.param_hash(engine.module), engine.optimizer.qwz.gathers)
    engine.optimizer.update_lp_params()
    return {
        "hash_unchanged": qwz.param_hash(engine.module) == before[0],
        "extra_gathers": engine.optimizer.qwz.gathers - before[1],
    }


def _full_flat_scales(engine: Any) -> dict[str, torch.Tensor]:
    """Per parameter name: the scale behind each element in a DeepSpeed + qwz engine (all
    ranks' partitions gathered, then sliced where the parameter points into the flat)."""
    optimizer = engine.optimizer
    scales: dict[str, torch.Tensor] = {}
    for group, flat in enumerate(optimizer.bit16_groups_flat):
        own = _element_scales(engine, group)
        full = torch.empty(own.numel() * dist.get_world_size(), dtype=own.dtype, device=own.device)
        dist.all_gather_into_tensor(full, own)
        for name, param in engine.module.named_parameters():
            offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
            if 0 <= offset < flat.numel():
                scales[name] = full[offset : offset + param.numel()].view(param.shape)
    return scales


def parity_with_qwz_engine(
    stage: int, dtype: str, steps: int, *, quantized: bool, group_size: int = 64, seed: int = 0
) -> dict[str, Any]:
    """qwz's own engine against DeepSpeed (stock when not `quantized`, DeepSpeed + qwz
    otherwise) with the same model, data, seed and AdamW; every element of every parameter
    is compared after every step against the bound stated in test_deepspeed.py."""
    config = ds_config(
        stage=stage, dtype=dtype, quantized=quantized, group_size=group_size if quantized else None
    )
    own_engine = qwz.initialize(build_deepspeed_layout_mlp(seed), config=config)
    # Without quantization the reference is stock DeepSpeed, not qwz's passthrough.
    deepspeed_engine = _build(config, seed, plain=not quantized)
    working_dtype = DTYPES[dtype]
    violations = checked = 0
    worst_ratio = max_error = 0.0
    identical_steps = []
    losses: dict[str, list[float]] = {"qwz": [], "deepspeed": []}
    grad_norms: dict[str, list[float]] = {"qwz": [], "deepspeed": []}
    for step in range(1, steps + 1):
        losses["qwz"].append(_forward_backward(own_engine, seed, step))
        own_engine.step()
        grad_norms["qwz"].append(float(own_engine.global_grad_norm))
        losses["deepspeed"].append(_forward_backward(deepspeed_engine, seed, step))
        deepspeed_engine.step()
        grad_norms["deepspeed"].append(float(deepspeed_engine.get_global_grad_norm()))
        deepspeed_scales = _full_flat_scales(deepspeed_engine) if quantized else {}
        reference = dict(deepspeed_engine.module.named_parameters())
        identical = True
        for name, param in own_engine.module.named_parameters():
            ours, theirs = param.detach().float(), reference[name].detach().float()
            scales = torch.zeros_like(ours)
            if quantized:  # each side decodes within half its own group's scale
                own_scales = element_scales(own_engine.optimizer, name).float()
                scales = own_scales + deepspeed_scales[name]
            bound = element_bound(step, LR, BETAS, scales, theirs, ours, working_dtype)
            error = (ours - theirs).abs()
            violations += int((error > bound).sum())
            checked += error.numel()
            worst_ratio = max(worst_ratio, float((error / bound).max()))
            max_error = max(max_error, float(error.max()))
            identical = identical and torch.equal(ours, theirs)
        identical_steps.append(identical)
    return {
        "violations": violations,
        "checked": checked,
        "worst_ratio": worst_ratio,
        "max_error": max_error,
        "identical_steps": identical_steps,
        "losses": losses,
        "grad_norms": grad_norms,
        "group_sizes": (
            own_engine.optimizer.quantization_group_size,
            deepspeed_engine.optimizer.quantization_group_size
            if quantized
            else getattr(deepspeed_engine.optimizer, "quantization_group_size", None),
        ),
    }
