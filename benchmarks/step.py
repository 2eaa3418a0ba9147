"""Benchmarks (c) and (d) of issue 11, side by side in one run; read here, never asserted.

    python benchmarks/step.py [--world-size 2] [--width 4096] [--repeats 5]
                              [--group-sizes 64 8192]

(c) DeepSpeed ZeRO-2 bf16 ``engine.step()``: stock against the drop-in
    (``qwz.integrations.deepspeed.initialize``) with its defaults, on an MLP of two
    ``width x width`` linears (32M parameters at the default width).
(d) A full train step (forward, backward, step) of qwz's own engine, unquantized and
    quantized, against stock DeepSpeed's on the same model and data.

All engines live in the same ranks and are stepped in turn (ABC, ABC, ...), median of
`repeats`, so drift hits every variant alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.qualify.run.launch import launch

MICRO_BATCH = 8


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
    )


def _config(quantized: bool, group_size: int = 64) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 2, "allgather_bucket_size": 5e8, "reduce_bucket_size": 5e8}
    if quantized:
        zero["zero_quantized_weights"] = True
        zero["zero_quantized_weights_group_size"] = group_size
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        # DeepSpeed's own default for AdamW (FusedAdam; its CPU build here), not torch_adam:
        # torch's AdamW on CPU defaults to its slow single-tensor loop, which would hide
        # the gather in DeepSpeed's step and flatter qwz's engine (foreach) in (d).
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }


def _forward_backward(engine: Any, width: int, step: int) -> None:
    generator = torch.Generator().manual_seed(step * 101 + dist.get_rank())
    inputs = torch.randn(MICRO_BATCH, width, generator=generator).to(torch.bfloat16)
    loss = engine(inputs).float().pow(2).mean()
    engine.backward(loss)


def _bench_rank(width: int, repeats: int, group_sizes: list[int]) -> dict[str, dict]:
    import deepspeed

    from qwz.integrations import deepspeed as qwz_deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    engines: dict[str, Any] = {}
    model = _model(width)
    engines["stock DeepSpeed"], *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(False)
    )
    for group_size in group_sizes:
        model = _model(width)
        engines[f"drop-in G={group_size}"], *_ = qwz_deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(True, group_size)
        )
    engines["qwz engine unquantized"] = qwz.initialize(_model(width), config=_config(False))
    for group_size in group_sizes:
        engines[f"qwz engine G={group_size}"] = qwz.initialize(
            _model(width), config=_config(True, group_size)
        )
    step_times: dict[str, list[float]] = {name: [] for name in engines}
    full_times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(repeats + 1):  # the first round warms up (and compiles)
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            _forward_backward(engine, width, step)
            dist.barrier()
            step_start = time.perf_counter()
            engine.step()
            dist.barrier()
            end = time.perf_counter()
            if step:
                step_times[name].append(end - step_start)
                full_times[name].append(end - start)
    return {
        "step": {name: statistics.median(values) for name, values in step_times.items()},
        "full": {name: statistics.median(values) for name, values in full_times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[64, 8192])
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds for the whole run (DeepSpeed's start-up is slow)",
    )
    args = parser.parse_args()
    times = launch(
        _bench_rank,
        args.world_size,
        args.width,
        args.repeats,
        args.group_sizes,
        timeout_s=args.timeout,
    )[0]
    params = 2 * (args.width * args.width + args.width)
    print(f"{params / 1e6:.1f}M parameters, world size {args.world_size}, bf16 ZeRO-2")
    for kind, title in (("step", "(c) engine.step()"), ("full", "(d) full train step")):
        stock = times[kind]["stock DeepSpeed"]
        print(f"{title}: median ms, and speed-up vs stock DeepSpeed (>1: faster)")
        print("| variant | ms | vs stock |")
        print("|---|---|---|")
        for name, value in times[kind].items():
            print(f"| {name} | {value * 1e3:.0f} | {stock / value:.2f}x |")


if __name__ == "__main__":
    main()
