"""``qwz-qualify run`` refuses, before any rank starts, a run whose arms cannot fit on a GPU
([Note: GPU memory estimate], qwz/qualify/gpu_memory.py), with the estimate in the message.
No GPU here: the GPUs the run would use and their free memory are faked."""

from __future__ import annotations

import importlib.util

import pytest

from qwz.qualify import cli, gpu_memory, preflight

GIB = 2**30
QWEN3_4B_NUMEL = 4_022_468_096
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the qwen3 workloads need transformers (the qualify extra: pip install 'qwz[qualify]')",
)


def run_problems(tmp_path, monkeypatch, free_gib: float, *argv: str) -> list[str]:
    monkeypatch.setattr(gpu_memory, "indices_for_run", lambda world_size, torchrun: [0, 1])
    monkeypatch.setattr(
        gpu_memory,
        "free_bytes",
        lambda indices: {i: (int(free_gib * GIB), 141 * GIB) for i in indices},
    )
    args = cli.build_parser().parse_args(
        ["run", "--workload", "qwen3-4b", "--out", str(tmp_path / "out"), *argv]
    )
    return [line for line in preflight.check_run_request(args) if "cuda:" in line]


@NEEDS_TRANSFORMERS
def test_a_run_that_cannot_fit_a_gpu_is_refused_with_the_estimate(tmp_path, monkeypatch):
    """Qwen3-4B in bf16 on 2 ranks: two resident arms need about 2 x 45 GiB + 1 GiB."""
    lines = run_problems(tmp_path, monkeypatch, 60, "--world-size", "2")
    assert len(lines) == 2 and lines[0].startswith(
        "--world-size 2: cuda:0 has 60.0 GiB free of 141.0 GiB"
    )
    needed = (gpu_memory.CONTEXT_BYTES + 2 * gpu_memory.arm_bytes(QWEN3_4B_NUMEL, 2, "bf16")) / GIB
    assert f"about {needed:.1f} GiB needed at least" in lines[0]
    assert "2 arms of 4,022,468,096 parameters in bf16" in lines[0]
    assert "--one-arm-at-a-time would hold one arm" in lines[0]


@NEEDS_TRANSFORMERS
def test_one_arm_at_a_time_fits_where_two_do_not(tmp_path, monkeypatch):
    assert run_problems(tmp_path, monkeypatch, 60, "--world-size", "2", "--one-arm-at-a-time") == []


@NEEDS_TRANSFORMERS
def test_a_gpu_too_small_for_one_arm_says_so(tmp_path, monkeypatch):
    lines = run_problems(tmp_path, monkeypatch, 20, "--world-size", "2", "--one-arm-at-a-time")
    assert "1 arm of" in lines[0] and "use more ranks or a smaller workload" in lines[0]


@NEEDS_TRANSFORMERS
def test_a_run_that_fits_passes(tmp_path, monkeypatch):
    assert run_problems(tmp_path, monkeypatch, 95, "--world-size", "2") == []


def test_gloo_ranks_skip_the_gpu_preflight(monkeypatch):
    monkeypatch.setenv("QWZ_BACKEND", "gloo")
    assert gpu_memory.indices_for_run(4, under_torchrun=False) == []


def test_an_unreadable_gpu_is_a_problem_not_a_crash():
    def broken(indices):
        raise RuntimeError("torch.cuda.mem_get_info failed: no CUDA GPUs are available")

    lines = gpu_memory.problems(
        world_size=2, numel=10, dtype="bf16", one_arm_at_a_time=False, indices=[0], query=broken
    )
    assert lines == [
        "GPU memory preflight: cannot read free memory of cuda:[0]: "
        "torch.cuda.mem_get_info failed: no CUDA GPUs are available"
    ]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_estimate_counts_weights_gradients_and_the_fp32_shards(dtype):
    working = gpu_memory.WORKING_BYTES[dtype]
    assert gpu_memory.arm_bytes(1000, 4, dtype) == 1000 * 2 * working + 250 * 16
