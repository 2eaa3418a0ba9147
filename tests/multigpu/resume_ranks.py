"""Rank-side functions for the drop-in resume tests (run on every rank by LocalWorld).

Each call trains a DeepSpeed + qwz engine, saves a checkpoint, builds a second
engine from another seed and loads the checkpoint into it one way; it returns
plain data on whether the fp32 masters came back exactly, or were rebuilt from
the quantized working weights, or the load was refused, and, where asked, whether
both engines stay bit-identical for more steps on the same batches.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.integrations.deepspeed import LossyResumeError
from tests.multigpu.deepspeed_ranks import _build, _forward_backward, ds_config
from tests.multigpu.models import build_deepspeed_layout_mlp
from tests.multigpu.ranks import LR

TAG = "resume"
LOADS: dict[str, dict[str, Any]] = {
    "full": {},
    "optimizer_states_false": {"load_optimizer_states": False},
    "module_only": {"load_module_only": True},
    "bit16_weights": {},  # zero_optimization.load_from_fp32_weights: false in the config
    "missing_zero_checkpoint": {},  # DeepSpeed finds no ZeRO checkpoint (see save_then_load)
    "module_only_zero_files_deleted": {"load_module_only": True},
    "module_only_zero_file_of_rank1_deleted": {"load_module_only": True},
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


def _engine(config: dict[str, Any], seed: int, optimizer: str) -> Any:
    """Adam(W) from the config, or a client ``torch.optim.SGD`` without momentum: an optimizer
    with no state, so a load that skips the optimizer state still resumes exactly."""
    if optimizer == "adamw":
        return _build(config, seed)
    config = {k: v for k, v in config.items() if k != "optimizer"}
    config["zero_allow_untested_optimizer"] = True
    model = build_deepspeed_layout_mlp(seed)
    return _build_with(config, model, torch.optim.SGD(model.parameters(), lr=LR))


def _build_with(config: dict[str, Any], model: Any, client_optimizer: Any) -> Any:
    from qwz.integrations import deepspeed as qwz_deepspeed

    engine, *_ = qwz_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_optimizer, config=config
    )
    return engine


def _delete_zero_files(checkpoint_dir: str, ranks: list[int] | None) -> None:
    """Delete the zero_pp_rank_* files (of `ranks`, or all) after every rank has saved."""
    dist.barrier()
    if dist.get_rank() == 0:
        for path in glob.glob(os.path.join(checkpoint_dir, TAG, "*zero_pp_rank_*")):
            if ranks is None or any(f"zero_pp_rank_{r}_" in path for r in ranks):
                os.remove(path)
    dist.barrier()


def save_then_load(
    checkpoint_dir: str,
    how: str,
    steps: int = 2,
    seed: int = 0,
    stage: int = 2,
    optimizer: str = "adamw",
    more_steps: int = 0,
) -> dict[str, Any]:
    """Train `steps` steps, save, load into a fresh engine `how`; then step both engines
    `more_steps` more times on the same batches."""
    config = ds_config(stage=stage, group_size=64)
    saved = _engine(config, seed, optimizer)
    for step in range(1, steps + 1):
        _forward_backward(saved, seed, step)
        saved.step()
    saved.save_checkpoint(checkpoint_dir, tag=TAG)
    saved_masters = _masters(saved)
    if how == "module_only_zero_files_deleted":
        _delete_zero_files(checkpoint_dir, None)
    if how == "module_only_zero_file_of_rank1_deleted":
        _delete_zero_files(checkpoint_dir, [1])

    load_config = ds_config(stage=stage, group_size=64)
    if how == "bit16_weights":
        load_config["zero_optimization"]["load_from_fp32_weights"] = False
    loaded = _engine(load_config, seed + 1, optimizer)
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
        "masters_exact_after_steps": [],
        "hashes_after_steps": [],
    }
    for step in range(steps + 1, steps + 1 + more_steps):
        for engine in (saved, loaded):
            _forward_backward(engine, seed, step)
            engine.step()
        result["masters_exact_after_steps"].append(
            all(map(torch.equal, _masters(loaded), _masters(saved)))
        )
        result["hashes_after_steps"].append(
            (qwz.param_hash(saved.module), qwz.param_hash(loaded.module))
        )
    return result


def refresh_outside_a_load(steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """``optimizer.refresh_fp32_params()`` called directly: no checkpoint is known."""
    engine = _build(ds_config(stage=2, group_size=64), seed)
    for step in range(1, steps + 1):
        _forward_backward(engine, seed, step)
        engine.step()
    before = _masters(engine)
    error = None
    try:
        engine.optimizer.refresh_fp32_params()
    except LossyResumeError as refused:
        error = str(refused)
    return {"error": error, "masters_unchanged": all(map(torch.equal, _masters(engine), before))}
