"""fp16 training in qwz's engine on real process groups (gloo on CPU, 2 ranks).

DeepSpeed's CPU accelerator refuses fp16 on CPUs without AVX512-FP16, so this is where fp16
ZeRO-1/2 training with dynamic loss scaling ([Note: dynamic loss scale]) is covered on every
machine: against a plain torch reference with DeepSpeed's own loss scaler, with one rank
alone overflowing at SPIKE_STEP.

The rank bodies come first (run on every rank by LocalWorld, which finds them by this
module's path), the tests after them. Each rank trains qwz's engine and, beside it, a plain
torch reference: an fp16 model, fp32 master copies stepped by torch.optim.AdamW, gradients
divided by the world size and then summed by ``dist.all_reduce`` in fp16 (as DeepSpeed
averages them), and DeepSpeed's own loss scaler deciding the scale and which steps to skip.
One rank alone overflows at `spike_step` (only one small parameter's gradient), so a skip
that only that rank saw would show up as ranks that disagree.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import qwz
from qwz import devices
from qwz.config import QwzConfig
from qwz.hashing import tensors_hash
from qwz.integrations.probe import WireProbe
from tests.loss_scale_reference import deepspeed_scaler, step_masters
from tests.multigpu import models, ranks

FP16_SECTION = {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 2}
"""The scale grows from 2**12 until the gradients overflow, then halves and grows again."""
SPIKE_RANK = 1


def fp16_config(stage: int, quantized: bool) -> dict[str, Any]:
    config = ranks.ds_config(stage=stage, quantized=quantized, dtype="fp32", lr=1e-2)
    config["fp16"] = {"enabled": True, **FP16_SECTION}
    return config


Batch = tuple[torch.Tensor, torch.Tensor, bool]


def _batch(seed: int, step: int, spike_step: int) -> Batch:
    """(inputs, targets, spike): `spike` on SPIKE_RANK at `spike_step` only."""
    inputs, targets = models.batch(seed, step, dist.get_rank(), torch.float32)
    spike = step == spike_step and dist.get_rank() == SPIKE_RANK
    return inputs.half(), targets, spike


def _loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """MSE in fp32; a spike adds ``1e30 * head.bias.sum()``: only head.bias's (3-element)
    fp16 gradient overflows, on one rank, so at stage 2 only the rank that owns it would see
    the overflow in its own shard."""
    inputs, targets, spike = batch
    device = models.device_of(model)
    loss = torch.nn.functional.mse_loss(model(inputs.to(device)).float(), targets.to(device))
    if spike:
        loss = loss + 1e30 * model.head.bias.float().sum()
    return loss


class _Reference:
    """Plain torch data parallelism in fp16 with DeepSpeed's loss scaler."""

    def __init__(self, config: dict[str, Any], seed: int):
        # On the group's device, like the engine's model: its all-reduce runs on that group.
        self.model = models.build_odd_width_mlp(seed).to(devices.group_device(), torch.float16)
        self.masters = [p.detach().float().clone() for p in self.model.parameters()]
        params = config["optimizer"]["params"]
        self.adam = torch.optim.AdamW(
            self.masters, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
            weight_decay=0.0,
        )  # fmt: skip
        self.scaler = deepspeed_scaler(QwzConfig.from_deepspeed(config).loss_scale)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, bool]:
        self.model.zero_grad()
        scale = self.scaler.cur_scale
        (_loss(self.model, batch).float() * scale).backward()
        grads = []
        for param in self.model.parameters():
            dist.all_reduce(param.grad.div_(dist.get_world_size()))  # averaged before the sum
            grads.append(param.grad.float() / scale)
        overflow = not all(bool(torch.isfinite(grad).all()) for grad in grads)
        self.scaler.update_scale(overflow)
        if not overflow:
            step_masters(self.adam, self.masters, self.model, grads)
        return scale, overflow


def fp16_with_overflows(stage: int, quantized: bool, steps: int, spike_step: int) -> dict[str, Any]:
    """Train qwz's engine and the reference side by side; per step record what each did."""
    seed = 0
    config = fp16_config(stage, quantized)
    engine = qwz.initialize(models.build_odd_width_mlp(seed), config=config)
    reference = _Reference(config, seed)
    result: dict[str, Any] = {
        "dtype": str(next(engine.module.parameters()).dtype),
        "group_size": engine.optimizer.quantization_group_size,
        "steps": [],
    }
    for step in range(1, steps + 1):
        batch = _batch(seed, step, spike_step)
        scale = engine.loss_scale
        before = qwz.param_hash(engine.module)
        masters = tensors_hash(engine.optimizer.master_shards().items())
        engine.backward(_loss(engine.module, batch))
        with WireProbe() as probe:
            stepped = engine.step()
        reference_scale, reference_overflow = reference.step(batch)
        result["steps"].append(
            {
                "scale": scale,
                "stepped": stepped,
                "finite_norm": math.isfinite(engine.global_grad_norm),
                "skipped_steps": engine.skipped_steps,
                "gather_bytes": probe.bytes["gather"],
                "hash_unchanged": qwz.param_hash(engine.module) == before,
                "masters_unchanged": tensors_hash(engine.optimizer.master_shards().items())
                == masters,
                "hash": qwz.param_hash(engine.module),
                "reference_scale": reference_scale,
                "reference_overflow": reference_overflow,
                "reference_hash": qwz.param_hash(reference.model),
            }
        )
    return result


def _train_fp16(engine: qwz.Engine, first: int, last: int, spike_step: int) -> list[tuple]:
    """Steps first..last; after each, the parameter hash, the loss scale and whether it
    stepped."""
    trace = []
    for step in range(first, last + 1):
        engine.backward(_loss(engine.module, _batch(0, step, spike_step)))
        stepped = engine.step()
        trace.append((qwz.param_hash(engine.module), engine.loss_scale, stepped))
    return trace


def resume_fp16(directory: str, stage: int, save_at: int, total: int, spike_step: int) -> dict:
    """The uninterrupted run against one saved after `save_at` steps and resumed in a fresh
    engine (another seed): the loss scaler's state (scale, hysteresis left, last overflow)
    must come back with the weights, or the resumed run skips other steps."""
    config = fp16_config(stage, quantized=True)
    expected = _train_fp16(
        qwz.initialize(models.build_odd_width_mlp(0), config=config), 1, total, spike_step
    )
    first = qwz.initialize(models.build_odd_width_mlp(0), config=config)
    before = _train_fp16(first, 1, save_at, spike_step)
    first.save_checkpoint(directory)
    del first
    resumed = qwz.initialize(models.build_odd_width_mlp(99), config=config)
    resumed.load_checkpoint(directory)
    return {
        "expected": expected,
        "resumed": before + _train_fp16(resumed, save_at + 1, total, spike_step),
        "skipped_steps": resumed.skipped_steps,
    }


# --------------------------------------------------------------------------- #
# The tests
# --------------------------------------------------------------------------- #

pytestmark = pytest.mark.multigpu

STEPS, SPIKE_STEP = 16, 14


def check_skips(results: list[dict]) -> list[bool]:
    """Every rank skipped the same steps, a skipped step gathered nothing and changed no
    weight or master, a taken step did both; returns which steps overflowed."""
    overflows = [not step["stepped"] for step in results[0]["steps"]]
    for rank, result in enumerate(results):
        assert result["dtype"] == "torch.float16"
        assert [not step["stepped"] for step in result["steps"]] == overflows, rank
        for index, step in enumerate(result["steps"], start=1):
            where = f"rank {rank}, step {index}"
            assert step["skipped_steps"] == sum(overflows[:index]), where
            if step["stepped"]:
                assert step["finite_norm"] and step["gather_bytes"] > 0, where
                assert not step["hash_unchanged"] and not step["masters_unchanged"], where
            else:
                assert not step["finite_norm"] and step["gather_bytes"] == 0, where
                assert step["hash_unchanged"] and step["masters_unchanged"], where
    for index in range(len(overflows)):
        assert len({result["steps"][index]["hash"] for result in results}) == 1, index
        assert len({result["steps"][index]["scale"] for result in results}) == 1, index
    # What the run claims to exercise: overflows from the scale, the one-rank spike, and a
    # scale that both grows and shrinks.
    assert any(overflows[: SPIKE_STEP - 1]) and overflows[SPIKE_STEP - 1], overflows
    scales = [step["scale"] for step in results[0]["steps"]]
    pairs = list(itertools.pairwise(scales))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs), scales
    return overflows


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_unquantized_equals_plain_torch_with_deepspeeds_scaler(worlds, stage):
    """Without quantization every step's weights equal the reference's bit for bit, and
    the scale and the skipped steps are DeepSpeed's loss scaler's."""
    results = worlds.get(2).run(fp16_with_overflows, stage, False, STEPS, SPIKE_STEP)
    overflows = check_skips(results)
    for rank, result in enumerate(results):
        for index, step in enumerate(result["steps"], start=1):
            where = f"rank {rank}, step {index}"
            assert step["scale"] == step["reference_scale"], where
            assert (not step["stepped"]) == step["reference_overflow"], where
            assert step["hash"] == step["reference_hash"], where
    print(f"stage {stage}: overflowed steps {[i + 1 for i, o in enumerate(overflows) if o]}")


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_quantized_skips_overflows_on_every_rank_together(worlds, stage):
    """With the quantized gather: the same skip discipline, replicas identical after every
    step, and the gather really quantized."""
    results = worlds.get(2).run(fp16_with_overflows, stage, True, STEPS, SPIKE_STEP)
    check_skips(results)
    assert all(result["group_size"] == 64 for result in results)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_resume_restores_the_loss_scale_bit_for_bit(worlds, tmp_path, stage):
    """Saved after step 10 (its overflow spent a unit of hysteresis; the next one
    halves the scale), resumed in a fresh engine: every later step's hash, scale and skip
    equal the uninterrupted run's."""
    save_at = 10
    results = worlds.get(2).run(resume_fp16, str(tmp_path), stage, save_at, STEPS, SPIKE_STEP)
    for rank, result in enumerate(results):
        assert result["resumed"] == result["expected"], rank
        skips = [not stepped for _, _, stepped in result["expected"]]
        assert result["skipped_steps"] == sum(skips)
        assert any(skips[:save_at]) and any(skips[save_at:]), skips  # the state mattered
    assert results[0]["expected"] == results[1]["expected"]
