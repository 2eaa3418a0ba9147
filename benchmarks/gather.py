"""Benchmarks (a) and (b) of issue 11, side by side in one run; read here, never asserted.

    python benchmarks/gather.py [--world-sizes 2 4] [--numels 1048576 16777216 67108864]
                                [--group-sizes 64 8192] [--repeats 5]

(a) The weight-gather phase -- qwz's quantized gather (fused kernels, one collective per
    chunk, double-buffered), from the fp32 master shard into the bf16 working buffer --
    against stock ``all_gather_into_tensor`` of the same bf16 flat buffer (what DeepSpeed
    does), per world size, group size and buffer size (elements of the whole buffer), plus
    the raw collective of the int8 rows alone (what the wire allows).
(b) Quantize + dequantize element rate (one rank, fused kernels) against a bf16 copy of
    the same buffer, on one thread (as each rank of the gather runs: ``qwz.qualify.run.launch`` and
    torchrun give every rank one thread) and on torch's default thread count.

Each variant is timed interleaved with its baseline (AB, AB, ...), median of `repeats`
rounds at 16M elements and more, proportionally more below (a 1M-element gather takes a
few milliseconds, where one scheduler tick on a shared machine is a large share), so
drift hits both alike. On a GPU machine the same script runs with NCCL and CUDA tensors.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from qwz.collectives import Staging, gather
from qwz.kernels import choose_kernels, native_kernels
from qwz.layout import plan_gather
from qwz.qualify.run.launch import launch
from qwz.quant import WireRow, row_codes, row_scales

BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``allgather_bucket_size``."""


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _timed(fn: Callable[[], object], device: torch.device, barrier: bool) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rounds(repeats: int, numel: int) -> int:
    """`repeats` rounds at 16M elements and more; as many more below as keeps the time per
    size about the same, at most 20x."""
    return repeats * min(20, max(1, (1 << 24) // numel))


def _interleaved(variants: dict[str, Callable[[], object]], repeats: int, barrier: bool):
    device = _device()
    for fn in variants.values():  # warm-up (and compile)
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(_timed(fn, device, barrier))
    return {name: statistics.median(values) for name, values in times.items()}


def _gather_rank(numel: int, group_size: int, repeats: int) -> dict[str, float]:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = _device()
    shard_numel = -(-numel // (world_size * group_size)) * group_size
    flat = torch.zeros(world_size * shard_numel, dtype=torch.bfloat16, device=device)
    master = torch.randn(shard_numel, device=device)
    plan = plan_gather(
        world_size=world_size,
        source_numel=shard_numel,
        quantize=True,
        group_size=group_size,
        element_size=2,
        bucket_bytes=BUCKET_ELEMENTS * 2,
    )
    staging, kernels = Staging(device), choose_kernels(None).kernels
    stock_rows = flat.view(world_size, shard_numel)
    row = WireRow(shard_numel // group_size, group_size, 0, 2)
    raw_rows = torch.zeros(world_size, row.row_bytes, dtype=torch.uint8, device=device)

    def stock() -> None:
        stock_rows[rank].copy_(master)  # DeepSpeed copies the stepped master in first
        dist.all_gather_into_tensor(flat, stock_rows[rank])

    def qwz() -> None:
        gather(plan, master, stock_rows, rank=rank, staging=staging, kernels=kernels)

    def wire_only() -> None:
        dist.all_gather_into_tensor(raw_rows.view(-1), raw_rows[rank])

    variants = {"stock": stock, "qwz": qwz, "wire": wire_only}
    return _interleaved(variants, _rounds(repeats, numel), True)


def _kernel_rate(numel: int, group_size: int, repeats: int) -> dict[str, float]:
    device = _device()
    kernels = choose_kernels(None).kernels
    master = torch.randn(numel, device=device)
    bf16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    out = torch.empty(1, numel, dtype=torch.bfloat16, device=device)
    row = WireRow(numel // group_size, group_size, 0, 2)
    rows = torch.empty(1, row.row_bytes, dtype=torch.uint8, device=device)
    scales, codes = row_scales(rows, row), row_codes(rows, row)

    def copy() -> None:
        bf16.copy_(master)

    def quantize_dequantize() -> None:
        kernels.encode(master, scales[0], codes[0])
        kernels.decode(scales, codes, out)

    variants = {"bf16 copy": copy, "quant+dequant": quantize_dequantize}
    return _interleaved(variants, _rounds(repeats, numel), False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numels", type=int, nargs="+", default=[1 << 20, 1 << 24, 1 << 26])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[64, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-gather", action="store_true")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    native, why_not = native_kernels()
    on_cpu = f"native C, {native.threading}" if native else f"not native: {why_not}"
    print(f"kernels: {choose_kernels(None).kernels.name} (on CPU: {on_cpu})")
    print("(b) quantize + dequantize vs a bf16 copy, one rank")
    print("| threads | elements | G | bf16 copy ms | quant+dequant ms | rate vs copy |")
    print("|---|---|---|---|---|---|")
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        for numel in args.numels:
            for group_size in args.group_sizes:
                times = _kernel_rate(numel, group_size, args.repeats)
                copy, both = times["bf16 copy"], times["quant+dequant"]
                cells = [
                    threads,
                    numel,
                    group_size,
                    f"{copy * 1e3:.2f}",
                    f"{both * 1e3:.2f}",
                    f"{copy / both:.2f}",
                ]
                print("| " + " | ".join(str(cell) for cell in cells) + " |")
    torch.set_num_threads(default_threads)
    if args.skip_gather:
        return
    print("(a) gather phase: stock bf16 all_gather_into_tensor vs qwz, and the int8 wire alone")
    print("| W | elements | G | stock ms | qwz ms | qwz speed-up | wire-only speed-up |")
    print("|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        for numel in args.numels:
            for group_size in args.group_sizes:
                times = launch(_gather_rank, world_size, numel, group_size, args.repeats)[0]
                stock, ours, wire = times["stock"], times["qwz"], times["wire"]
                print(
                    f"| {world_size} | {numel} | {group_size} | {stock * 1e3:.1f} | "
                    f"{ours * 1e3:.1f} | {stock / ours:.2f}x | {stock / wire:.2f}x |"
                )


if __name__ == "__main__":
    main()
