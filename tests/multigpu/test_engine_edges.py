"""qwz's engine at its edges, on real process groups: frozen parameters and buffers at
initialisation, checkpoints and resume.

The rank bodies come first (run on every rank by LocalWorld, which finds them by this
module's path), the tests after them. Every rank body returns plain data (hashes, messages)
for the test process to assert on.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import qwz
from qwz.hashing import tensors_hash
from tests.multigpu import models, ranks


class FrozenBaseNet(torch.nn.Module):
    """A frozen base Linear with a trainable low-rank adapter (LoRA-style), BatchNorm (running
    statistics are buffers) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 32)
        self.base.requires_grad_(False)
        self.adapter_down = torch.nn.Linear(16, 4, bias=False)
        self.adapter_up = torch.nn.Linear(4, 32, bias=False)
        self.norm = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.base(x) + self.adapter_up(self.adapter_down(x))
        return self.head(torch.tanh(self.norm(hidden)))


def buffer_hash(module: torch.nn.Module) -> str:
    return tensors_hash(module.named_buffers())


def frozen_and_buffers_after_initialize(stage: int) -> dict[str, str]:
    """Every rank builds its model from its own seed and perturbs its BatchNorm statistics;
    after initialize every hash must be rank 0's."""
    torch.manual_seed(100 + dist.get_rank())
    model = FrozenBaseNet()
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.num_batches_tracked.fill_(dist.get_rank() + 3)
    before = {"params": qwz.param_hash(model), "buffers": buffer_hash(model)}
    engine = qwz.initialize(
        model, config=ranks.ds_config(stage=stage, quantized=True, dtype="fp32")
    )
    frozen = [(name, p) for name, p in engine.module.named_parameters() if not p.requires_grad]
    return {
        "params_before": before["params"],
        "buffers_before": before["buffers"],
        "params": qwz.param_hash(engine.module),
        "buffers": buffer_hash(engine.module),
        "frozen": tensors_hash(frozen),
    }


# --------------------------------------------------------------------------- #
# Checkpoints
# --------------------------------------------------------------------------- #


def _train_steps(engine: qwz.Engine, first: int, last: int, seed: int) -> list[str]:
    """Optimizer steps first..last (1-based, one micro-batch each); the hash after each."""
    hashes = []
    for step in range(first, last + 1):
        engine.backward(ranks._loss(engine, seed, step, 0))
        assert engine.step()
        hashes.append(qwz.param_hash(engine.module))
    return hashes


def resume_matches_uninterrupted(
    directory: str, stage: int, save_at: int, total: int, dtype: str = "bf16"
) -> dict[str, Any]:
    """Run A trains `total` steps; run B trains `save_at` steps, saves, and a fresh engine
    built from another seed loads the checkpoint and trains the remaining steps."""
    config = ranks.ds_config(stage=stage, quantized=True, dtype=dtype)
    uninterrupted = qwz.initialize(models.build_odd_width_mlp(0), config=config)
    expected = _train_steps(uninterrupted, 1, total, seed=0)

    first = qwz.initialize(models.build_odd_width_mlp(0), config=config)
    before_save = _train_steps(first, 1, save_at, seed=0)
    first.save_checkpoint(directory)
    del first
    resumed = qwz.initialize(models.build_odd_width_mlp(12345), config=config)
    resumed.load_checkpoint(directory)
    at_load = qwz.param_hash(resumed.module)
    counters = (resumed.global_steps, resumed.micro_steps)
    after_load = _train_steps(resumed, save_at + 1, total, seed=0)
    return {
        "expected": expected,
        "resumed": before_save + after_load,
        "at_load": at_load,
        "counters": counters,
        "quantization_group_size": resumed.optimizer.quantization_group_size,
    }


def save_small_checkpoint(directory: str, stage: int, steps: int = 2) -> str:
    engine = qwz.initialize(
        models.build_odd_width_mlp(0),
        config=ranks.ds_config(stage=stage, quantized=True, dtype="fp32"),
    )
    _train_steps(engine, 1, steps, seed=0)
    engine.save_checkpoint(directory)
    return qwz.param_hash(engine.module)


def load_is_all_or_nothing(directory: str, stage: int) -> dict[str, Any]:
    """Load a checkpoint one of whose rank files was damaged by the test: every rank must
    refuse with the same error, and no rank (not even one whose own file is intact) may
    have changed its weights, masters or step counters."""
    engine = qwz.initialize(
        models.build_odd_width_mlp(7),
        config=ranks.ds_config(stage=stage, quantized=True, dtype="fp32"),
    )
    before = qwz.param_hash(engine.module)
    masters = {name: m.clone() for name, m in engine.optimizer.master_shards().items()}
    try:
        engine.load_checkpoint(directory)
        message = None
    except qwz.CheckpointError as error:
        message = str(error)
    unchanged = qwz.param_hash(engine.module) == before and all(
        torch.equal(master, masters[name])
        for name, master in engine.optimizer.master_shards().items()
    )
    return {"message": message, "unchanged": unchanged, "steps": engine.global_steps}


def rank_file(directory: str, rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"rank{rank:05d}.pt"


# --------------------------------------------------------------------------- #
# The tests
# --------------------------------------------------------------------------- #

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("stage", [1, 2])
def test_initialize_broadcasts_frozen_parameters_and_buffers_from_rank0(worlds, stage):
    results = worlds.get(2).run(frozen_and_buffers_after_initialize, stage)
    # The ranks really did start different, in the frozen base and in the buffers alike.
    assert results[0]["params_before"] != results[1]["params_before"]
    assert results[0]["buffers_before"] != results[1]["buffers_before"]
    for key in ("params", "buffers", "frozen"):
        assert results[0][key] == results[1][key], key
    # Rank 0's state won: its hashes did not move (the model was already in fp32).
    assert results[0]["params"] == results[0]["params_before"]
    assert results[0]["buffers"] == results[0]["buffers_before"]


RESUME_SAVE_AT, RESUME_TOTAL = 3, 6


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_gives_the_hashes_of_the_uninterrupted_run(worlds, tmp_path, stage):
    """2 ranks, bf16, quantized gather: save after step 3, load into a fresh engine built
    from another seed, train to step 6; every hash equals the uninterrupted run's."""
    results = worlds.get(2).run(
        resume_matches_uninterrupted,
        str(tmp_path),
        stage,
        RESUME_SAVE_AT,
        RESUME_TOTAL,
    )
    for rank, result in enumerate(results):
        assert result["quantization_group_size"] == 64, rank  # the gather really quantizes
        assert result["counters"] == (RESUME_SAVE_AT, RESUME_SAVE_AT), rank
        assert result["at_load"] == result["expected"][RESUME_SAVE_AT - 1], rank
        assert result["resumed"] == result["expected"], rank
    assert results[0]["expected"] == results[1]["expected"]
    assert len(set(results[0]["expected"])) == RESUME_TOTAL  # every step moved the weights
    print(
        f"stage {stage}: final hash uninterrupted {results[0]['expected'][-1]}, "
        f"resumed {results[0]['resumed'][-1]}"
    )


def test_two_rank_checkpoint_refused_at_one_rank_and_damage_refused_on_every_rank(worlds, tmp_path):
    saved_hashes = worlds.get(2).run(save_small_checkpoint, str(tmp_path), 2)
    assert saved_hashes[0] == saved_hashes[1]
    # This test process has no process group: an engine of world size 1.
    single = qwz.initialize(
        models.build_odd_width_mlp(0), config=ranks.ds_config(stage=2, quantized=True, dtype="fp32")
    )
    with pytest.raises(qwz.CheckpointError) as refused:
        single.load_checkpoint(tmp_path)
    assert "world_size is 2 in the checkpoint but 1 in this engine" in str(refused.value)
    # Rank 1's file damaged: rank 0's own file is intact, yet neither rank loads anything.
    rank_file(str(tmp_path), 1).write_bytes(b"not a checkpoint")
    results = worlds.get(2).run(load_is_all_or_nothing, str(tmp_path), 2)
    messages = {result["message"] for result in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "rank 1: " in message and "rank00001.pt is damaged" in message
    assert "rank 0: " not in message
    for result in results:
        assert result["unchanged"] and result["steps"] == 0
