"""[Note: collectives on the group's device] (qwz/devices.py) on a CPU-only machine: the
backend string, the rank's CUDA device from LOCAL_RANK and where ``qwz.initialize`` puts
the model, with torch.cuda and the process group faked (nothing here touches a GPU)."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

import qwz
from qwz import devices

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


@pytest.mark.parametrize(
    ("backend", "cuda"),
    [("nccl", True), ("gloo", False), ("cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:gloo", False)],
)
def test_uses_cuda_reads_each_part_of_the_backend(backend: str, cuda: bool) -> None:
    assert devices.uses_cuda(backend) is cuda


def test_a_backend_part_without_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="'cuda' is not device:backend"):
        devices.backend_devices("cpu:gloo,cuda")


class FakeCuda:
    """torch.cuda as a host with `count` GPUs sees it; records set_device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0):
        self.current = current
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, index: int) -> None:
        self.set_calls.append(index)
        self.current = index


def fake_group(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """An initialised one-rank default group whose backend reads `backend`."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_local_cuda_device_sets_the_device_from_local_rank(monkeypatch) -> None:
    cuda = FakeCuda(monkeypatch, count=4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devices.local_cuda_device() == torch.device("cuda", 2)
    assert cuda.set_calls == [2]


def test_local_rank_beyond_the_gpus_is_refused_by_name(monkeypatch) -> None:
    FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3: this host has 2 CUDA devices"):
        devices.local_cuda_device()


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:gloo"])
def test_group_device_is_the_cpu_for_gloo(monkeypatch, backend: str) -> None:
    FakeCuda(monkeypatch, count=4)
    fake_group(monkeypatch, backend)
    assert devices.group_device() == torch.device("cpu")


class Placed(Exception):
    """Raised by RecordingModel.to: where the engine put the model (no GPU needed)."""


class RecordingModel(torch.nn.Linear):
    def to(self, *args, **kwargs):  # type: ignore[override]
        raise Placed(args, kwargs)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_initialize_puts_the_model_on_cuda_local_rank_in_the_working_dtype(
    monkeypatch, backend: str
) -> None:
    """Every rank of a node used to land on torch.cuda.current_device() (cuda:0), and a
    mixed backend left the model on the CPU."""
    cuda = FakeCuda(monkeypatch, count=4, current=0)
    fake_group(monkeypatch, backend)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(Placed) as placed:
        qwz.initialize(RecordingModel(4, 4), config=CONFIG)
    args, kwargs = placed.value.args
    assert args == ()
    assert kwargs == {"device": torch.device("cuda", 3), "dtype": torch.bfloat16}
    assert cuda.set_calls == [3]


def test_initialize_leaves_a_gloo_model_where_it_is(monkeypatch) -> None:
    FakeCuda(monkeypatch, count=4)
    fake_group(monkeypatch, "gloo")
    with pytest.raises(Placed) as placed:
        qwz.initialize(RecordingModel(4, 4), config=CONFIG)
    assert placed.value.args[1] == {"device": None, "dtype": torch.bfloat16}


def test_gloo_gives_deepspeed_the_cpu_accelerator(monkeypatch) -> None:
    """A host with fewer GPUs than ranks falls back to gloo; DeepSpeed, left alone, would
    still choose CUDA. A DeepSpeed accelerator chosen already is replaced."""
    real_accelerator = pytest.importorskip(
        "deepspeed.accelerator.real_accelerator",
        reason="needs DeepSpeed installed (the deepspeed extra: pip install 'qwz[deepspeed]')",
    )

    cuda_like = types.SimpleNamespace(device_name=lambda: "cuda")
    monkeypatch.setattr(real_accelerator, "ds_accelerator", cuda_like)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    devices.use_cpu_accelerator_for_gloo("gloo")
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert real_accelerator.ds_accelerator.device_name() == "cpu"


def test_nccl_leaves_deepspeed_its_cuda_accelerator(monkeypatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    devices.use_cpu_accelerator_for_gloo("cpu:gloo,cuda:nccl")
    assert "DS_ACCELERATOR" not in os.environ
