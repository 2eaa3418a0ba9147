"""The device checks ``ci/gpu-check.sh`` runs, one subcommand each; exit 0 when it holds.

    python ci/gpu_checks.py pipeline --device cuda      # 2-buffer gather, delayed copies
    python ci/gpu_checks.py engine-repeat --device cuda # one-rank step, bitwise repeatable
    python ci/gpu_checks.py kernel-bytes --device cuda  # CUDA kernels' bytes vs eager/CPU

Each prints one line starting with ``PASS``, ``FAIL`` or ``MISSING`` and a reason. The
first two also run on ``--device cpu`` (synchronously), which is how the CPU suite tests
their logic (tests/unit/test_gpu_check_script.py).
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
        budget_bytes=1 << 40,
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


CHECKS = {"pipeline": pipeline, "engine-repeat": engine_repeat, "kernel-bytes": kernel_bytes}


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
