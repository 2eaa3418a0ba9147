"""Checkpoints of qwz's engine at world size 1 (no process group): a round trip restores
the masters, optimizer state, counters, frozen parameters and buffers exactly; anything
damaged or of another layout is refused with nothing loaded. The multi-rank resume is in
tests/multigpu/test_engine_edges.py."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

import qwz
from qwz.checkpoint import MANIFEST, rank_file_name
from qwz.hashing import tensors_hash


class NetWithState(torch.nn.Module):
    """A quantized-region Linear (with preserve_numel 64), a frozen Linear, BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(12, 24)
        self.frozen = torch.nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(24)
        self.head = torch.nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.frozen(self.up(x)))))


def config(*, stage: int = 2, group_size: int = 8, accumulation: int = 1, dtype: str = "fp32"):
    return {
        "zero_optimization": {
            "stage": stage,
            "zero_quantized_weights": True,
            "zero_quantized_weights_group_size": group_size,
            "zero_quantized_weights_preserve_numel": 64,
        },
        "gradient_accumulation_steps": accumulation,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    }


def engine_for(seed: int, **options: Any) -> qwz.Engine:
    torch.manual_seed(seed)
    return qwz.initialize(NetWithState(), config=config(**options))


def train(engine: qwz.Engine, first: int, last: int) -> None:
    for step in range(first, last + 1):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(6, 12, generator=generator)
        targets = torch.randn(6, 2, generator=generator)
        dtype = engine.module.up.weight.dtype
        loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
        engine.backward(loss)
        engine.step()


def snapshot(engine: qwz.Engine) -> dict[str, Any]:
    return {
        "params": qwz.param_hash(engine.module),
        "buffers": tensors_hash(engine.module.named_buffers()),
        "masters": tensors_hash(engine.optimizer.master_shards().items()),
        "adam": tensors_hash(
            (f"{index}.{key}", value)
            for index, entry in engine.optimizer.shard_optimizer.state_dict()["state"].items()
            for key, value in entry.items()
        ),
        "steps": (engine.global_steps, engine.micro_steps),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[pathlib.Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("checkpoint")
    engine = engine_for(0)
    train(engine, 1, 3)
    engine.save_checkpoint(directory)
    return directory, snapshot(engine)


def copy_of(saved_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / "copy"
    target.mkdir()
    for path in saved_dir.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_equals_the_uninterrupted_run(tmp_path, stage, dtype):
    uninterrupted = engine_for(0, stage=stage, dtype=dtype)
    train(uninterrupted, 1, 4)
    first = engine_for(0, stage=stage, dtype=dtype)
    train(first, 1, 2)
    first.save_checkpoint(tmp_path)
    resumed = engine_for(99, stage=stage, dtype=dtype)  # other weights and buffers
    manifest = resumed.load_checkpoint(tmp_path)
    assert snapshot(resumed) == snapshot(first)
    assert manifest["param_hash"] == qwz.param_hash(resumed.module)
    train(resumed, 3, 4)
    assert snapshot(resumed) == snapshot(uninterrupted)


def test_manifest_names_the_layout_and_every_rank_file(saved):
    directory, _ = saved
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["world_size"] == 1 and manifest["stage"] == 2
    assert manifest["group_size"] == 8 and manifest["dtype"] == "fp32"
    assert manifest["global_steps"] == 3 and manifest["micro_steps"] == 3
    (entry,) = manifest["files"]
    assert entry["name"] == rank_file_name(0)
    assert entry["bytes"] == (directory / rank_file_name(0)).stat().st_size
    assert not [path for path in directory.iterdir() if ".tmp." in path.name]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"stage": 1}, "stage is 2 in the checkpoint but 1 in this engine"),
        ({"group_size": 16}, "group_size is 8 in the checkpoint but 16 in this engine"),
        ({"dtype": "bf16"}, "dtype is 'fp32' in the checkpoint but 'bf16' in this engine"),
    ],
)
def test_another_layout_is_refused_naming_the_mismatch(saved, options, named):
    directory, _ = saved
    engine = engine_for(5, **options)
    before = snapshot(engine)
    with pytest.raises(qwz.CheckpointError, match="nothing was loaded") as refused:
        engine.load_checkpoint(directory)
    assert named in str(refused.value)
    assert snapshot(engine) == before


def flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_manifest(path: pathlib.Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["global_steps"] = 1000
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "target", "named"),
    [
        (flip_a_byte, rank_file_name(0), "rank00000.pt is damaged"),
        (truncate, rank_file_name(0), "rank00000.pt is damaged"),
        (truncate, MANIFEST, "manifest.json is unreadable"),
        (edit_manifest, MANIFEST, "does not match its digest"),
        (lambda path: path.unlink(), MANIFEST, "no manifest.json"),
        (lambda path: path.unlink(), rank_file_name(0), "rank00000.pt: No such file"),
    ],
    ids=["flipped-byte", "truncated-rank-file", "truncated-manifest", "edited-manifest",
         "no-manifest", "no-rank-file"],
)  # fmt: skip
def test_a_damaged_checkpoint_is_refused_and_nothing_changes(
    saved, tmp_path, damage, target, named
):
    directory = copy_of(saved[0], tmp_path)
    damage(directory / target)
    engine = engine_for(5)
    train(engine, 1, 1)
    before = snapshot(engine)
    with pytest.raises(qwz.CheckpointError) as refused:
        engine.load_checkpoint(directory)
    assert named in str(refused.value)
    assert snapshot(engine) == before


def test_save_in_the_middle_of_an_accumulation_window_is_refused(tmp_path):
    engine = engine_for(0, accumulation=2)
    train(engine, 1, 1)  # one micro-batch of two
    with pytest.raises(qwz.CheckpointError, match="micro-batch 1 of 2"):
        engine.save_checkpoint(tmp_path)
    assert not (tmp_path / MANIFEST).exists()


def test_save_after_a_backward_without_its_step_is_refused(tmp_path):
    engine = engine_for(0)
    train(engine, 1, 1)
    inputs = torch.randn(6, 12)
    engine.backward(engine(inputs).square().mean())
    with pytest.raises(qwz.CheckpointError, match="gradients of an unfinished accumulation"):
        engine.save_checkpoint(tmp_path)
    assert not (tmp_path / MANIFEST).exists()


def test_fixed_loss_scale_checkpoint_is_refused_by_a_dynamic_fp16_engine(tmp_path):
    """The loss scaler's mode must match: nothing is loaded, and the error says why."""

    def fp16_engine(fp16: dict[str, Any]) -> qwz.Engine:
        torch.manual_seed(0)
        return qwz.initialize(NetWithState(), config={**config(), "fp16": fp16})

    saved = fp16_engine({"enabled": True, "loss_scale": 8.0})
    train(saved, 1, 2)
    saved.save_checkpoint(tmp_path)
    dynamic = fp16_engine({"enabled": True})
    before = snapshot(dynamic)
    with pytest.raises(
        qwz.CheckpointError, match="saved loss scale is fixed, this engine's is dynamic"
    ):
        dynamic.load_checkpoint(tmp_path)
    assert snapshot(dynamic) == before
