"""Side-by-side benchmark of the weight gather: bf16 vs int8 (eager) vs int8 (torch.compile).

    python benchmarks/gather.py [--world-size 2] [--numel 16777216] [--repeats 10]

Runs on spawned local ranks (gloo on CPU, NCCL with enough GPUs) and prints, for
one buffer of `numel` working-dtype elements, the median time of each variant
and its ratio to the bf16 gather measured in the same run, interleaved so that
drift hits every variant alike. Speed targets are read here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from qwz.collectives import gather_shards
from qwz.launch import launch
from qwz.layout import plan_chunks, quantized_unit_bytes
from qwz.quant import EAGER_KERNELS, compiled_kernels


def _bench_rank(numel: int, repeats: int, group_size: int, bucket: int) -> dict[str, list[float]]:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    shard_numel = -(-numel // (world_size * group_size)) * group_size
    full = torch.zeros(world_size * shard_numel, dtype=torch.bfloat16, device=device)
    master = torch.randn(shard_numel, device=device)
    budget = bucket * 2
    plain_plan = plan_chunks(shard_numel, world_size, group_size, group_size * 2, budget)
    quant_plan = plan_chunks(
        shard_numel, world_size, group_size, quantized_unit_bytes(group_size), budget
    )
    variants = {
        "bf16": dict(plan=plain_plan, quantize=False, kernels=EAGER_KERNELS),
        "int8 eager": dict(plan=quant_plan, quantize=True, kernels=EAGER_KERNELS),
        "int8 compiled": dict(plan=quant_plan, quantize=True, kernels=compiled_kernels()),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for options in variants.values():  # warm-up (and compile)
        gather_shards(master, full, rank=rank, **options)
    for _ in range(repeats):
        for name, options in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            gather_shards(master, full, rank=rank, **options)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--bucket", type=int, default=500_000_000)
    args = parser.parse_args()
    times = launch(
        _bench_rank, args.world_size, args.numel, args.repeats, args.group_size, args.bucket
    )[0]
    baseline = statistics.median(times["bf16"])
    print(f"{args.numel} elements, world size {args.world_size}, G={args.group_size}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:14s} {median * 1e3:9.2f} ms   speed-up vs bf16 {baseline / median:5.2f}x")


if __name__ == "__main__":
    main()
