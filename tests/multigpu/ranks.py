"""Rank-side functions for the multigpu engine tests (run on every rank by LocalWorld).

Each function builds the tiny ``OddWidthMLP`` (tests/multigpu/models.py) from a
seed, trains it with qwz's engine and returns plain data (losses, hashes,
samples, byte counts) for the test process to assert on. Models are tiny on
purpose: the whole CPU suite stays in minutes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.integrations.probe import WireProbe
from qwz.qualify.evidence.tolerance import element_bound
from tests.multigpu.models import MICRO_BATCH, batch, build_odd_width_mlp, device_of
from tests.multigpu.scales import element_scales

LR = 1e-3
BETAS = (0.9, 0.999)


def ds_config(
    *,
    stage: int,
    quantized: bool,
    dtype: str,
    group_size: int = 64,
    bucket: float = 5e8,
    clipping: float = 0.0,
    accumulation: int = 1,
    lr: float = LR,
    preserve: int | None = None,
    eps: float = 1e-8,
) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        "zero_quantized_weights": quantized,
        "zero_quantized_weights_group_size": group_size,
        "allgather_bucket_size": bucket,
        "reduce_bucket_size": 5e8,
    }
    if preserve is not None:
        zero["zero_quantized_weights_preserve_numel"] = preserve
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(BETAS), "eps": eps}},
    }


def _loss(engine: qwz.Engine, seed: int, step: int, micro: int) -> torch.Tensor:
    rank = dist.get_rank()
    dtype = next(engine.module.parameters()).dtype
    inputs, targets = batch(seed, step * 100 + micro, rank, dtype, device_of(engine.module))
    return torch.nn.functional.mse_loss(engine(inputs).float(), targets)


def train(config: dict[str, Any], steps: int, seed: int = 0) -> dict[str, Any]:
    """Train for `steps` optimizer steps; record losses, norms, per-step hashes, wire bytes."""
    engine = qwz.initialize(build_odd_width_mlp(seed), config=config)
    accumulation = config.get("gradient_accumulation_steps", 1)
    result: dict[str, Any] = {
        "losses": [],
        "grad_norms": [],
        "hashes": [],
        "gather_bytes": [],
        "gather_calls": [],
        "largest_gather_output_bytes": 0,
        "group_size": engine.optimizer.quantization_group_size,
        "stage": engine.optimizer.stage,
        "reported": [],
    }
    for step in range(steps):
        for micro in range(accumulation):
            loss = _loss(engine, seed, step, micro)
            result["losses"].append(loss.item())
            engine.backward(loss)
            with WireProbe() as probe:
                stepped = engine.step()
            assert stepped == (micro == accumulation - 1), (step, micro, stepped)
        result["grad_norms"].append(engine.global_grad_norm)
        result["hashes"].append(qwz.param_hash(engine.module))
        result["gather_bytes"].append(probe.bytes["gather"])
        result["gather_calls"].append(probe.calls["gather"])
        result["largest_gather_output_bytes"] = max(
            result["largest_gather_output_bytes"], probe.largest_gather_output_bytes
        )
        result["reported"].append(
            {name: stats._asdict() for name, stats in engine.optimizer.last_gather.items()}
        )
    result["final_params"] = {
        name: param.detach().float().cpu() for name, param in engine.module.named_parameters()
    }
    result["regions"] = {
        region.name: {
            "shard_numel": region.layout.shard_numel,
            "numel": region.layout.numel,
            "chunks": len(engine.optimizer.gather_plan.chunks),
            "quantize": region.quantize,
        }
        for region in engine.optimizer.regions
    }
    return result


def compare_arms(
    stage: int, dtype: str, steps: int, group_size: int = 64, seed: int = 0, sample: int = 512
) -> dict[str, Any]:
    """Run the reference (unquantized) and candidate (quantized) arms side by side and check a
    fixed sample of parameter elements against the [Note: parameter-sample tolerance] bound."""
    reference = qwz.initialize(
        build_odd_width_mlp(seed), config=ds_config(stage=stage, quantized=False, dtype=dtype)
    )
    candidate = qwz.initialize(
        build_odd_width_mlp(seed),
        config=ds_config(stage=stage, quantized=True, dtype=dtype, group_size=group_size),
    )
    working_dtype = next(candidate.module.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)
    names = [name for name, _ in candidate.module.named_parameters()]
    samples = {}
    for name, param in candidate.module.named_parameters():
        count = min(sample, param.numel())
        samples[name] = torch.randperm(param.numel(), generator=generator)[:count]
    violations = checked = 0
    worst_ratio = 0.0
    master_equal_after_step1 = None
    master_on_grid = None
    for step in range(1, steps + 1):
        for engine in (reference, candidate):
            loss = _loss(engine, seed, step, 0)
            engine.backward(loss)
            engine.step()
        if step == 1:
            ref_master = reference.optimizer.master_shards()
            cand_master = candidate.optimizer.master_shards()
            master_equal_after_step1 = all(
                torch.equal(ref_master[k], cand_master[k]) for k in ref_master
            )
            quantized_master = cand_master["quantized"]
            regrid = qwz.dequantize(qwz.quantize(quantized_master, group_size), torch.float32)
            master_on_grid = bool(torch.equal(regrid, quantized_master))
        ref_params = dict(reference.module.named_parameters())
        cand_params = dict(candidate.module.named_parameters())
        for name in names:
            index = samples[name]
            ref_values = ref_params[name].detach().reshape(-1)[index].float()
            cand_values = cand_params[name].detach().reshape(-1)[index].float()
            scales = element_scales(candidate.optimizer, name).reshape(-1)[index]
            bound = element_bound(step, LR, BETAS, scales, ref_values, cand_values, working_dtype)
            error = (cand_values - ref_values).abs()
            violations += int((error > bound).sum())
            checked += index.numel()
            worst_ratio = max(worst_ratio, float((error / bound).max()))
    return {
        "violations": violations,
        "checked": checked,
        "worst_ratio": worst_ratio,
        "master_equal_after_step1": master_equal_after_step1,
        "master_on_grid": master_on_grid,
        "final_hashes": (qwz.param_hash(reference.module), qwz.param_hash(candidate.module)),
    }


def non_finite(kind: str, bad_rank: int, bad_step: int, steps: int = 5) -> dict[str, Any]:
    """Inject a non-finite gradient / weight / update on one rank and report what was raised."""
    engine = qwz.initialize(
        build_odd_width_mlp(0), config=ds_config(stage=2, quantized=True, dtype="fp32")
    )
    rank = dist.get_rank()
    hash_before = None
    for step in range(1, steps + 1):
        if kind == "weight" and step == bad_step and rank == bad_rank:
            with torch.no_grad():
                engine.module.mid.weight[0, 0] = float("nan")
        hash_before = qwz.param_hash(engine.module)
        loss = _loss(engine, 0, step, 0)
        if kind == "gradient" and step == bad_step and rank == bad_rank:
            loss = loss + engine.module.norm.bias.sum() * float("inf")
        if kind == "update" and step == bad_step and rank == bad_rank:
            # Corrupt this rank's Adam state: the gradients stay finite, the update does not.
            state = engine.optimizer.optimizer.state
            for region in engine.optimizer.regions:
                state[region.master]["exp_avg"][:1] = float("inf")
        engine.backward(loss)
        try:
            engine.step()
        except qwz.NonFiniteError as error:
            return {
                "step": step,
                "message": str(error),
                "hash_before": hash_before,
                "hash_after": qwz.param_hash(engine.module),
            }
    return {"step": None, "message": None}


def die_at_step(dying_rank: int, step_to_die: int) -> str:
    """Train; `dying_rank` exits abruptly at `step_to_die`, the others must not hang."""
    engine = qwz.initialize(
        build_odd_width_mlp(0), config=ds_config(stage=2, quantized=True, dtype="fp32")
    )
    for step in range(1, 10):
        if step == step_to_die and dist.get_rank() == dying_rank:
            os._exit(17)
        engine.backward(_loss(engine, 0, step, 0))
        engine.step()
    return "finished"


def initial_replicas(stage: int) -> str:
    """Every rank builds a *different* model (seeded by its rank); initialize must make all
    replicas rank 0's, exactly, before any step."""
    model = build_odd_width_mlp(seed=dist.get_rank())
    engine = qwz.initialize(model, config=ds_config(stage=stage, quantized=True, dtype="fp32"))
    return qwz.param_hash(engine.module)


def own_shard_decode_error(stage: int, steps: int = 3, group_size: int = 64) -> dict[str, Any]:
    """After every step, compare this rank's own slice of the quantized working buffer with
    its fp32 master shard: [Note: quantization math] promises |decoded - master| <= scale / 2
    with scale = group absmax / 127, computed here from the master itself (fp32 working copy,
    so no cast error). Returns the worst ratio error / (scale / 2) over all steps."""
    engine = qwz.initialize(
        build_odd_width_mlp(0),
        config=ds_config(stage=stage, quantized=True, dtype="fp32", group_size=group_size),
    )
    rank = dist.get_rank()
    region = next(r for r in engine.optimizer.regions if r.name == "quantized")
    worst = 0.0
    for step in range(1, steps + 1):
        engine.backward(_loss(engine, 0, step, 0))
        engine.step()
        start, end = region.shard_range(rank)
        master = region.master.detach().view(-1, group_size)
        decoded = region.working[start:end].float().view(-1, group_size)
        absmax = master.abs().amax(dim=1, keepdim=True)
        half_scale = absmax / 127 / 2
        # fp32 rounding of absmax / 127, x / scale and code * scale: a few eps of the absmax
        slack = 4 * torch.finfo(torch.float32).eps * absmax
        error = (decoded - master).abs()
        assert bool((error[half_scale.squeeze(1) == 0] == 0).all()), "zero group not exact"
        safe = torch.where(half_scale > 0, half_scale, torch.ones_like(half_scale))
        worst = max(worst, float(((error - slack) / safe).max()))
    return {"worst_ratio": worst}


def reduction_bytes(config: dict[str, Any]) -> dict[str, Any]:
    """Bytes one rank puts into gradient reductions over one micro-batch and step, and the
    padded element count of the reduced buffers (both regions)."""
    engine = qwz.initialize(build_odd_width_mlp(0), config=config)
    with WireProbe() as probe:
        engine.backward(_loss(engine, 0, 0, 0))
        engine.step()
    return {
        "reduce_bytes": probe.bytes["reduce"],
        "padded_numel": sum(region.layout.padded_numel for region in engine.optimizer.regions),
        "reduce_dtype": str(engine.optimizer.reduce_dtype),
    }
