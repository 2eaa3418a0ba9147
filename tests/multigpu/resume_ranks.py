"""Rank-side functions for the drop-in resume tests (run on every rank by LocalWorld).

Each call trains a DeepSpeed + qwz engine, saves a checkpoint, builds a second
engine from another seed and loads the checkpoint into it one way; it returns
plain data on whether the fp32 masters came back exactly, or were rebuilt from
the quantized working weights, or the load was refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.integrations.deepspeed import LossyResumeError
from tests.multigpu.deepspeed_ranks import _build, _forward_backward, ds_config

TAG = "resume"
LOADS: dict[str, dict[str, Any]] = {
    "full": {},
    "optimizer_states_false": {"load_optimizer_states": False},
    "module_only": {"load_module_only": True},
    "bit16_weights": {},  # zero_optimization.load_from_fp32_weights: false in the config
    "missing_zero_checkpoint": {},  # DeepSpeed finds no ZeRO checkpoint (see save_then_load)
}
"""How the checkpoint is loaded: ``load_checkpoint`` keyword arguments per way."""


def _masters(engine: Any) -> list[torch.Tensor]:
    return [m.detach().clone() for m in engine.optimizer.single_partition_of_fp32_groups]


def _masters_are_working_copy(engine: Any) -> bool:
    """True when every master partition equals this rank's bit16 partition upcast, which is
    what ``_restore_from_bit16_weights`` leaves behind."""
    optimizer = engine.optimizer
    rank = dist.get_rank(group=optimizer.real_dp_process_group[0])
    return all(
        torch.equal(master, partitions[rank].float())
        for master, partitions in zip(
            optimizer.single_partition_of_fp32_groups,
            optimizer.parallel_partitioned_bit16_groups,
            strict=True,
        )
    )


def save_then_load(checkpoint_dir: str, how: str, steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Train `steps` steps, save, load into a fresh engine `how`; for "full", also step both
    engines once more on the same batch."""
    config = ds_config(stage=2, group_size=64)
    saved = _build(config, seed)
    for step in range(1, steps + 1):
        _forward_backward(saved, seed, step)
        saved.step()
    saved.save_checkpoint(checkpoint_dir, tag=TAG)
    saved_masters = _masters(saved)

    load_config = ds_config(stage=2, group_size=64)
    if how == "bit16_weights":
        load_config["zero_optimization"]["load_from_fp32_weights"] = False
    loaded = _build(load_config, seed + 1)
    if how == "missing_zero_checkpoint":
        # DeepSpeed 0.19.8 raises FileNotFoundError for a deleted zero_pp_rank_* file; its
        # "no ZeRO checkpoint" branch (this method returning None, then
        # _restore_from_bit16_weights in load_checkpoint) is reached by an engine or checkpoint
        # engine that finds none, simulated here on this one engine object.
        loaded._get_all_zero_checkpoints = lambda load_dir, tag: None
    error = None
    try:
        loaded.load_checkpoint(checkpoint_dir, tag=TAG, **LOADS[how])
    except LossyResumeError as refused:
        error = str(refused)
    result: dict[str, Any] = {
        "error": error,
        "masters_exact": all(map(torch.equal, _masters(loaded), saved_masters)),
        "masters_are_working_copy": _masters_are_working_copy(loaded),
        "hashes_after_load": (qwz.param_hash(saved.module), qwz.param_hash(loaded.module)),
    }
    if how == "full":
        for engine in (saved, loaded):
            _forward_backward(engine, seed, steps + 1)
            engine.step()
        result["masters_exact_after_step"] = all(
            map(torch.equal, _masters(loaded), _masters(saved))
        )
        result["hashes_after_step"] = (qwz.param_hash(saved.module), qwz.param_hash(loaded.module))
    return result
