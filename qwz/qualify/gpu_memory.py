"""The per-GPU memory preflight of ``qwz-qualify run``: refuse before any rank starts when
the arms' model states cannot fit on a GPU.

[Note: GPU memory estimate]
Per GPU and resident arm: the working copy of the weights and its gradients (the whole
model, working dtype), plus this rank's shard of the fp32 masters, of Adam's two fp32
moments and of the fp32 gradient, ``numel * 2 * working_bytes + ceil(numel / W) * 16``
bytes, and a fixed allowance for the CUDA context and NCCL's buffers. Activations,
reduction buckets and staging are not counted, so the estimate is a lower bound: a run it
refuses cannot fit, and a run it lets through may still run out of memory. Timing keeps
the reference and one candidate resident (two arms) unless ``--one-arm-at-a-time``.

Free memory comes from ``torch.cuda.mem_get_info`` in a short child process, so the
parent (which stays alive while the ranks run) never holds a CUDA context on their GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CONTEXT_BYTES = 1 << 30
"""CUDA context, cuBLAS workspace and NCCL buffers per GPU (an allowance, not measured)."""
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SHARD_BYTES_PER_ELEMENT = 16
"""fp32 master, Adam's exp_avg and exp_avg_sq, fp32 gradient: 4 bytes each."""
QUERY_TIMEOUT_S = 120


def arm_bytes(numel: int, world_size: int, dtype: str) -> int:
    """[Note: GPU memory estimate] of one resident arm, per GPU."""
    shard_numel = -(-numel // world_size)
    return numel * 2 * WORKING_BYTES[dtype] + shard_numel * SHARD_BYTES_PER_ELEMENT


def free_bytes(indices: list[int]) -> dict[int, tuple[int, int]]:
    """(free, total) bytes per CUDA device index, from a child process."""
    code = (
        "import json, sys, torch\n"
        "print(json.dumps({i: torch.cuda.mem_get_info(i) for i in map(int, sys.argv[1:])}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, indices)],
        capture_output=True,
        text=True,
        timeout=QUERY_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"torch.cuda.mem_get_info failed: {last}")
    return {int(index): (free, total) for index, (free, total) in json.loads(done.stdout).items()}


def problems(
    *,
    world_size: int,
    numel: int,
    dtype: str,
    one_arm_at_a_time: bool,
    indices: list[int],
    query=None,
) -> list[str]:
    """One line per GPU in `indices` the run cannot fit on; [] when each fits the estimate."""
    if not indices:
        return []
    one_arm = arm_bytes(numel, world_size, dtype)
    resident = 1 if one_arm_at_a_time else 2
    needed = CONTEXT_BYTES + resident * one_arm
    try:
        free = (query or free_bytes)(indices)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
        return [f"GPU memory preflight: cannot read free memory of cuda:{indices}: {error}"]
    lines = []
    for index in indices:
        available, total = free[index]
        if needed <= available:
            continue
        line = (
            f"--world-size {world_size}: cuda:{index} has {available / 2**30:.1f} GiB free "
            f"of {total / 2**30:.1f} GiB; about {needed / 2**30:.1f} GiB needed at least "
            f"({resident} arm{'s' if resident > 1 else ''} of {numel:,} parameters in "
            f"{dtype} resident at {one_arm / 2**30:.2f} GiB each, weights, gradients, fp32 "
            "master, Adam and gradient shards, plus 1 GiB for the CUDA context; "
            "activations not counted)"
        )
        if resident > 1 and CONTEXT_BYTES + one_arm <= available:
            line += "; --one-arm-at-a-time would hold one arm"
        else:
            line += "; use more ranks or a smaller workload"
        lines.append(line)
    return lines


def indices_for_run(world_size: int, under_torchrun: bool) -> list[int]:
    """The GPUs this process's run puts ranks on: cuda:LOCAL_RANK under torchrun, cuda:0..W-1
    for local NCCL ranks, none for gloo."""
    import torch

    from qwz.devices import uses_cuda
    from qwz.qualify.run.launch import pick_backend

    if under_torchrun:
        return [int(os.environ.get("LOCAL_RANK", "0"))] if torch.cuda.is_available() else []
    return list(range(world_size)) if uses_cuda(pick_backend(world_size)) else []
