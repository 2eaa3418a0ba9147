"""The per-GPU memory preflight of ``qwz-qualify run``: refuse before any rank starts when
the arms' model states and activations cannot fit on a GPU, and hold one arm at a time
where two do not fit but one does.

[Note: GPU memory estimate]
Per GPU and resident arm: the working copy of the weights and its gradients (the whole
model, working dtype), plus this rank's shard of the fp32 masters, of Adam's two fp32
moments and of the fp32 gradient, ``numel * 2 * working_bytes + ceil(numel / W) * 16``
bytes. Once per GPU (one arm trains at a time): the activations one training step keeps
for its backward ([Note: activation estimate]) and a fixed allowance for the CUDA context
and NCCL's buffers. Reduction buckets, staging and temporaries are not counted, so the
estimate is a lower bound: a run it refuses cannot fit, and a run it lets through may
still run out of memory. Timing keeps the reference and one candidate resident (two arms)
unless ``--one-arm-at-a-time``; where two arms do not fit and one does, and the command
line did not say ``--no-one-arm-at-a-time``, the preflight chooses one arm at a time and
says so (qualify/request/preflight.py), and the record's plan shows it.

[Note: activation estimate]
What a Qwen3 step saves for its backward, per token (micro-batch x sequence), with w the
working dtype's bytes and 4 those of float32 (transformers' Qwen3: its RMSNorms compute in
float32, its loss takes float32 logits). Per decoder layer: two RMSNorms over the hidden
size h, each keeping its float32 input, its normalised value and its output (``h * (4 +
2w) + 4``), and the query and key RMSNorms over the a query and k key-value heads of
width d (``(a + k) * (d * (4 + w) + 4)``); the MLP's gate, its SiLU, its up projection and
the down projection's input (``4 * i * w``); attention, eager: the query, the repeated
keys and values and the output projection's input (``4 * a * d * w``) and the softmax
probabilities of every head over the sequence s, in float32 and again in the working
dtype (``a * s * (4 + w)``, ``a * s * 4`` in fp32); attention, SDPA: the query, the key
and value heads, the output and the log-sum-exp (``(2a + 2k) * d * w + 4a``), nothing
quadratic in s. Once: the final norm and the float32 log-softmax of the vocabulary V
(``V * 4``). On Qwen3-4B at sequence 2048 the eager probabilities alone are 27 GiB over
36 layers; with SDPA the whole step keeps about 13 GiB. tests/unit/qualify/
test_gpu_memory_preflight.py holds the formula against the bytes autograd saves on a small
Qwen3. The MLP and MoE workloads keep a few kilobytes (each layer's input and output).

Free memory comes from ``torch.cuda.mem_get_info`` in a short child process, so the
parent (which stays alive while the ranks run) never holds a CUDA context on their GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

CONTEXT_BYTES = 1 << 30
"""CUDA context, cuBLAS workspace and NCCL buffers per GPU (an allowance, not measured)."""
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SHARD_BYTES_PER_ELEMENT = 16
"""fp32 master, Adam's exp_avg and exp_avg_sq, fp32 gradient: 4 bytes each."""
FLOAT32_BYTES = 4
QUERY_TIMEOUT_S = 120


def arm_bytes(numel: int, world_size: int, dtype: str) -> int:
    """[Note: GPU memory estimate] of one resident arm, per GPU."""
    shard_numel = -(-numel // world_size)
    return numel * 2 * WORKING_BYTES[dtype] + shard_numel * SHARD_BYTES_PER_ELEMENT


def activation_bytes(params: Mapping[str, Any], dtype: str) -> int:
    """[Note: activation estimate] of one training step of the workload with `params`."""
    w, f = WORKING_BYTES[dtype], FLOAT32_BYTES
    micro_batch = params["micro_batch"]
    model = params.get("model")
    if model is None:  # the MLP and MoE workloads
        return micro_batch * sum(params["sizes"]) * 2 * w
    seq, h, i = params["seq_len"], model["hidden_size"], model["intermediate_size"]
    a, k, d = model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"]
    norms = 2 * (h * (f + 2 * w) + f) + (a + k) * (d * (f + w) + f)
    mlp = 4 * i * w
    if params.get("attention", "eager") == "eager":
        attention = 4 * a * d * w + a * seq * (f if w == f else f + w)
    else:
        attention = (2 * a + 2 * k) * d * w + a * f
    final = h * (f + 2 * w) + f + model["vocab_size"] * f
    layers = model["num_hidden_layers"]
    return micro_batch * seq * (layers * (norms + mlp + attention) + final)


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


class MemoryFit(NamedTuple):
    problems: list[str]
    """One line per GPU the run cannot fit on, with the estimate."""
    one_arm: bool
    """Whether the run must hold one arm at a time (two do not fit, one does)."""


def fit(
    *,
    world_size: int,
    numel: int,
    dtype: str,
    activations: int,
    one_arm_at_a_time: bool,
    may_choose: bool,
    indices: list[int],
    eager_attention: bool = False,
    query=None,
) -> MemoryFit:
    """[Note: GPU memory estimate] on every GPU in `indices`; `may_choose`: hold one arm where
    two do not fit and one does, instead of refusing."""
    if not indices:
        return MemoryFit([], one_arm_at_a_time)
    try:
        free = (query or free_bytes)(indices)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
        line = f"GPU memory preflight: cannot read free memory of cuda:{indices}: {error}"
        return MemoryFit([line], one_arm_at_a_time)
    one_arm = arm_bytes(numel, world_size, dtype)
    fixed = CONTEXT_BYTES + activations
    available = min(free[index][0] for index in indices)
    resident = 1 if one_arm_at_a_time else 2
    if resident == 2 and may_choose and fixed + 2 * one_arm > available >= fixed + one_arm:
        resident = 1
    needed = fixed + resident * one_arm
    lines = []
    for index in indices:
        if needed > free[index][0]:
            line = _refusal(index, free[index], world_size, numel, dtype, activations)
            lines.append(line + ("; --attention sdpa keeps less" if eager_attention else ""))
    return MemoryFit(lines, resident == 1)


def _refusal(
    index: int, free: tuple[int, int], world_size: int, numel: int, dtype: str, activations: int
) -> str:
    """Why cuda:`index` cannot hold the run, with the estimate and what would help."""
    available, total = free
    one_arm = arm_bytes(numel, world_size, dtype)
    fixed = CONTEXT_BYTES + activations
    resident = 2 if fixed + one_arm <= available else 1
    needed = fixed + resident * one_arm
    line = (
        f"--world-size {world_size}: cuda:{index} has {available / 2**30:.1f} GiB free "
        f"of {total / 2**30:.1f} GiB; about {needed / 2**30:.1f} GiB needed at least "
        f"({resident} arm{'s' if resident > 1 else ''} of {numel:,} parameters in "
        f"{dtype} resident at {one_arm / 2**30:.2f} GiB each, weights, gradients, fp32 "
        f"master, Adam and gradient shards; {activations / 2**30:.2f} GiB of activations "
        "of one step; 1 GiB for the CUDA context)"
    )
    if resident > 1:
        return line + "; --one-arm-at-a-time would hold one arm"
    return line + "; use more ranks or a smaller workload"


def indices_for_run(world_size: int, under_torchrun: bool, backend: str) -> list[int]:
    """The GPUs this process's run puts ranks on: cuda:LOCAL_RANK under torchrun, cuda:0..W-1
    for local NCCL ranks (`backend`: theirs, run/launch.py's ``pick_backend``), none for
    gloo."""
    import torch

    from qwz.devices import uses_cuda

    if under_torchrun:
        return [int(os.environ.get("LOCAL_RANK", "0"))] if torch.cuda.is_available() else []
    return list(range(world_size)) if uses_cuda(backend) else []
