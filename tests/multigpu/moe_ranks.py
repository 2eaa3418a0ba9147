"""Rank-side functions for the drop-in with DeepSpeed's MoE (run on every rank by LocalWorld).

DeepSpeed's ZeRO-1/2 optimizer keeps expert parameters in param groups of their
own (``moe: True``), partitioned over the expert-data-parallel group (the ranks
holding the same experts), and dense parameters partitioned over the whole
data-parallel group. :func:`train` trains ``models.MoEMLP`` through
``qwz.integrations.deepspeed.initialize`` and returns plain data: which process
group each param group is partitioned and gathered over, the bytes each gather
put on the wire per group, per-parameter hashes after every step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qwz.hashing import tensors_hash
from qwz.integrations import deepspeed as qwz_deepspeed
from qwz.integrations.probe import WireProbe
from tests.multigpu import models
from tests.multigpu.deepspeed_ranks import _quiet, ds_config

AUX_LOSS_WEIGHT = 0.01


def _expert_group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"  # the name deepspeed.moe.layer.MoE gives its groups


def _expert_parallel_rank(ep_size: int) -> int:
    """This rank's index in its expert-parallel group, which decides the experts it holds.

    The groups are created here, before the model, with DeepSpeed's own function; the MoE
    layer finds them by name when the engine sets it up and does not create them again."""
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed()
    name = _expert_group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_rank(name)


def _build(stage: int, ep_size: int, num_experts: int, seed: int) -> Any:
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    _quiet()
    model = models.build_moe_mlp(seed, num_experts, ep_size, _expert_parallel_rank(ep_size))
    # DeepSpeed's ZeRO optimizer needs the experts in param groups of their own.
    param_groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"}
    )
    engine, *_ = qwz_deepspeed.initialize(
        model=model,
        model_parameters=param_groups,
        config=ds_config(stage=stage, dtype="bf16", group_size=64),
    )
    return engine


def _exact_numels(engine: Any, group: int) -> list[int]:
    """Per owner rank of param group `group`: elements of its partition that belong to
    parameters of at most preserve_numel elements (these travel exactly). Found from where
    the module's parameters point into the flat buffer, independently of qwz's plan."""
    optimizer = engine.optimizer
    flat = optimizer.bit16_groups_flat[group]
    partitions = optimizer.parallel_partitioned_bit16_groups[group]
    partition_numel = partitions[0].numel()
    counts = [0] * len(partitions)
    for param in engine.module.parameters():
        offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
        if not 0 <= offset < flat.numel() or param.numel() > optimizer.qwz.preserve_numel:
            continue
        for owner in range(len(partitions)):
            first, last = owner * partition_numel, (owner + 1) * partition_numel
            counts[owner] += max(0, min(offset + param.numel(), last) - max(offset, first))
    return counts


def _param_group_facts(engine: Any) -> list[dict[str, Any]]:
    """Per DeepSpeed param group: its parameters, whether it is an MoE group, the global ranks
    of the process group DeepSpeed partitions it over and of the one qwz gathers it over."""
    optimizer = engine.optimizer
    names = {param: name for name, param in engine.module.named_parameters()}
    facts = []
    for i, param_group in enumerate(optimizer.optimizer.param_groups):
        rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
        partition = optimizer.parallel_partitioned_bit16_groups[i][rank]
        facts.append(
            {
                "moe": bool(param_group.get("moe", False)),
                "params": sorted(names[param] for param in optimizer.round_robin_bit16_groups[i]),
                "partitioned_over": dist.get_process_group_ranks(
                    optimizer.real_dp_process_group[i]
                ),
                "gathered_over": dist.get_process_group_ranks(optimizer.qwz.plans[i].process_group),
                "partition_numel": partition.numel(),
                "exact_numels": _exact_numels(engine, i),
            }
        )
    return facts


def train(stage: int, ep_size: int, num_experts: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Train `steps` steps; per step record the loss, per-parameter hashes and the gather
    bytes and calls per process group (global ranks -> count)."""
    from deepspeed.utils import groups

    engine = _build(stage, ep_size, num_experts, seed)
    optimizer = engine.optimizer
    expert_data_parallel_group = groups._get_expert_data_parallel_group(_expert_group_name(ep_size))
    result: dict[str, Any] = {
        "expert_data_parallel_ranks": dist.get_process_group_ranks(expert_data_parallel_group),
        "param_groups": _param_group_facts(engine),
        "group_size": optimizer.quantization_group_size,
        "losses": [],
        "hashes": [],
        "gather_bytes_by_group": [],
        "gather_calls_by_group": [],
        "qwz_gathers": [],
        "unquantized_bytes": qwz_deepspeed.unquantized_gather_bytes(optimizer),
    }
    for step in range(1, steps + 1):
        device = models.device_of(engine.module)
        inputs, targets = models.batch(seed, step, dist.get_rank(), torch.bfloat16, device)
        outputs, aux_loss = engine(inputs)
        loss = torch.nn.functional.mse_loss(outputs.float(), targets) + AUX_LOSS_WEIGHT * aux_loss
        engine.backward(loss)
        gathers_before = optimizer.qwz.gathers
        with WireProbe() as probe:
            engine.step()
        result["losses"].append(loss.item())
        result["hashes"].append(
            {name: tensors_hash([(name, p)]) for name, p in engine.module.named_parameters()}
        )
        result["gather_bytes_by_group"].append(dict(probe.gather_bytes_by_group))
        result["gather_calls_by_group"].append(dict(probe.gather_calls_by_group))
        result["qwz_gathers"].append(optimizer.qwz.gathers - gathers_before)
    result["working_is_master_cast"] = _working_is_master_cast(optimizer)
    return result


def _working_is_master_cast(optimizer: Any) -> list[bool]:
    """Per param group: does this rank's working partition equal its fp32 master cast to the
    working dtype? True for a one-rank group, which must be copied exactly ([Note: one rank
    gathers exactly], qwz/engine.py); False where the gather quantizes."""
    equal = []
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
        working = optimizer.parallel_partitioned_bit16_groups[i][rank]
        equal.append(bool(torch.equal(working, master.detach().to(working.dtype))))
    return equal
