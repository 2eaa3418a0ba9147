"""The device checks ``ci/gpu-check.sh`` runs, one subcommand each; exit 0 when it holds.

    python ci/gpu_checks.py pipeline --device cuda      # 2-buffer gather, delayed copies
    python ci/gpu_checks.py engine-repeat --device cuda # one-rank step, bitwise repeatable
    python ci/gpu_checks.py kernel-bytes --device cuda  # CUDA kernels' bytes vs eager/CPU
    python ci/gpu_checks.py zeropp-op --device cuda     # DeepSpeed's quantizer op vs ours

Each prints one line starting with ``PASS``, ``FAIL`` or ``MISSING`` and a reason. The
first two and ``zeropp-op`` also run on ``--device cpu`` (synchronously; ``zeropp-op`` then
compares the CPU implementation with itself), which is how the CPU suite tests their logic
(tests/unit/test_gpu_check_script.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

import torch

KERNEL_CHECK = "qwz.kernels:compare_with_eager"
"""The device byte probe (issue 22 item 4): called as ``compare_with_eager(device, dtype)``
for every working dtype; it raises, or returns a falsy value or an object with
``ok = False``, when the bytes differ from the eager kernels' on the CPU."""

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

DELAY_CYCLES = 20_000_000
"""GPU clock cycles the side stream sleeps before each copy (about 10 ms)."""


class _DelayedWork:
    """What an async NCCL collective returns: wait() orders the current stream after it."""

    def __init__(self, event: Any):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _delayed_all_gather(side_stream: Any):
    """An all-gather of two ranks on one device: rank 1 sends what rank 0 sends. On CUDA the
    copy runs on `side_stream` after a sleep, so a pipeline that reuses a buffer before its
    collective finished, or decodes before waiting, reads the wrong bytes."""

    def all_gather(output, slot, group=None, async_op=False):
        rows = output.view(2, -1)
        if side_stream is None:
            rows.copy_(slot.expand_as(rows))
            return _DelayedWork(None)
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            torch.cuda._sleep(DELAY_CYCLES)
            rows.copy_(slot.expand_as(rows))
            event = torch.cuda.Event()
            event.record(side_stream)
        slot.record_stream(side_stream)
        output.record_stream(side_stream)
        return _DelayedWork(event)

    return all_gather


def _gather_once(device: torch.device, delayed: bool) -> torch.Tensor:
    from qwz import collectives
    from qwz.kernels import choose_kernels
    from qwz.layout import plan_gather

    group_size, shard_numel = 64, 64 * 4096
    source = torch.randn(shard_numel, generator=torch.Generator().manual_seed(7)).to(device)
    dest = torch.zeros(2, shard_numel, dtype=torch.bfloat16, device=device)
    plan = plan_gather(
        world_size=2,
        source_numel=shard_numel,
        quantize=True,
        group_size=group_size,
        element_size=2,
        bucket_bytes=1 << 40,
        pipeline_numel=shard_numel // 8,
    )
    assert plan.num_buffers == 2 and len(plan.chunks) >= 4, plan
    side = torch.cuda.Stream(device) if delayed and device.type == "cuda" else None
    original = collectives._all_gather_into
    collectives._all_gather_into = _delayed_all_gather(side)
    try:
        staging = collectives.Staging(device)
        kernels = choose_kernels(None).kernels
        collectives.gather(plan, source, dest, rank=0, staging=staging, kernels=kernels)
    finally:
        collectives._all_gather_into = original
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dest.cpu()


def pipeline(device: torch.device) -> tuple[bool, str]:
    expected = _gather_once(device, delayed=False)
    got = _gather_once(device, delayed=True)
    if not torch.equal(expected[0], expected[1]):
        return False, "the synchronous gather's two rows differ"
    if torch.equal(got, expected):
        return True, f"2-buffer gather on {device} with delayed copies equals the synchronous one"
    wrong = int((got != expected).sum())
    return False, f"{wrong} elements differ from the synchronous gather (a pipeline race)"


def engine_repeat(device: torch.device, steps: int = 3) -> tuple[bool, str]:
    import qwz
    from qwz.qualify.run.determinism import deterministic
    from tests.multigpu.models import batch, build_odd_width_mlp
    from tests.multigpu.ranks import ds_config

    config = ds_config(stage=2, quantized=True, dtype="bf16")
    hashes = []
    with deterministic():
        for _ in range(2):
            engine = qwz.initialize(build_odd_width_mlp(0).to(device), config=config)
            for step in range(1, steps + 1):
                inputs, targets = batch(0, step, 0, torch.bfloat16, device)
                loss = torch.nn.functional.mse_loss(engine(inputs).float(), targets)
                engine.backward(loss)
                engine.step()
            hashes.append(qwz.param_hash(engine.module))
    if hashes[0] == hashes[1]:
        return True, f"two one-rank runs of {steps} steps on {device}: hash {hashes[0][:16]}"
    return False, f"two one-rank runs differ on {device}: {hashes[0][:16]} vs {hashes[1][:16]}"


def kernel_bytes(device: torch.device) -> tuple[bool | None, str]:
    module_name, _, function_name = KERNEL_CHECK.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        return None, f"{module_name} is missing ({error}); the device byte probe is not here"
    check = getattr(module, function_name, None)
    if check is None:
        return None, f"{KERNEL_CHECK} is missing; the device byte probe is not here"
    results = {dtype: check(device, dtype) for dtype in KERNEL_DTYPES}
    ok = all(bool(getattr(result, "ok", result)) for result in results.values())
    details = "; ".join(f"{dtype}: {result}" for dtype, result in results.items())
    return ok, f"{KERNEL_CHECK}({device}): {details}"


ZEROPP_GROUP_SIZES = (8, 64, 8192)
ZEROPP_DTYPES = (torch.float16, torch.bfloat16)


def _deepspeed_quantizer_op(device: torch.device) -> Any:
    """DeepSpeed's own quantizer op on `device` (its CUDA kernel, JIT-built), or on the CPU the
    harness's implementation ([Note: a CUDA-only subject on a CPU runner])."""
    from qwz.qualify.run import quantizer_op

    if device.type == "cpu":
        return quantizer_op.CPU_OP
    from deepspeed.ops.op_builder import QuantizerBuilder

    return QuantizerBuilder().load()


def _zeropp_case(op: Any, values: torch.Tensor, group_size: int, device: torch.device):
    """`values` (fp32 master, cast to its working dtype by the caller) through `op` and through
    the harness's CPU implementation: (codes, stored scales, decodes) of each, on the CPU."""
    from qwz.qualify.run import quantizer_op

    groups = values.numel() // group_size
    halves = values.half()
    results = []
    for quantizer, where in ((op, device), (quantizer_op.CPU_OP, torch.device("cpu"))):
        codes, params = quantizer.quantize(halves.to(where), groups, 8, quantizer.Symmetric)
        decoded = quantizer.dequantize(codes, params, groups, 8, quantizer.Symmetric)
        results.append((codes.cpu(), params.cpu().reshape(-1), decoded.cpu()))
    return results


def zeropp_op(device: torch.device) -> tuple[bool | None, str]:
    """DeepSpeed's quantizer op (the PR's kernel) against the harness's CPU implementation of
    it, element for element, on the edge cases of tests/unit/qualify/run/test_quantizer_op.py (an
    all-zero group, code ties, a positive and a negative absmax, fp16 subnormals) for fp16 and
    bf16 inputs and G = 8, 64, 8192. Holds when the judge accepts every element the kernel
    decodes as DeepSpeed's scheme ([Note: DeepSpeed's ZeRO++ scheme]); the elements where the
    two differ bit for bit are counted (fast math may move a near-tie)."""
    from qwz.qualify.evidence import contract
    from qwz.qualify.run.observers import own_shard
    from tests.unit.qualify.run.test_quantizer_op import edge_cases

    try:
        op = _deepspeed_quantizer_op(device)
    except Exception as error:  # no nvcc, no DeepSpeed: the comparison was not made
        return (
            None,
            f"DeepSpeed's quantizer op cannot be built here: {type(error).__name__}: {error}",
        )
    rows, accepted = [], True
    for dtype in ZEROPP_DTYPES:
        for group_size in ZEROPP_GROUP_SIZES:
            master = edge_cases(group_size)
            values = master.to(dtype)
            (codes, scales, decoded), (cpu_codes, cpu_scales, cpu_decoded) = _zeropp_case(
                op, values, group_size, device
            )
            working = decoded.to(dtype)
            exact = torch.zeros(master.numel(), dtype=torch.bool)
            verdict = own_shard._judge_piece(master, working, group_size, exact, contract.ZEROPP)
            mismatches = int(verdict.mismatch.sum())
            accepted &= mismatches == 0
            rows.append(
                f"{str(dtype).removeprefix('torch.')} G={group_size}: codes "
                f"{int((codes != cpu_codes).sum())}/{codes.numel()} differ, scales "
                f"{int((scales != cpu_scales).sum())}/{scales.numel()}, decodes "
                f"{int((decoded != cpu_decoded).sum())}; judge: {mismatches} outside the scheme"
            )
    return accepted, f"{device}: " + "; ".join(rows)


CHECKS = {
    "pipeline": pipeline,
    "engine-repeat": engine_repeat,
    "kernel-bytes": kernel_bytes,
    "zeropp-op": zeropp_op,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    ok, reason = CHECKS[args.check](torch.device(args.device))
    word = {True: "PASS", False: "FAIL", None: "MISSING"}[ok]
    print(f"{word} {args.check}: {reason}", flush=True)
    return {True: 0, False: 1, None: 4}[ok]


if __name__ == "__main__":
    sys.exit(main())
