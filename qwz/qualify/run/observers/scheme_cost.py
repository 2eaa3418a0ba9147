"""What the subject's quantization cost on this run, measured on its last weights.

[Note: what a scheme costs]
A reviewer who reads "this PR uses DeepSpeed's ZeRO++ quantizer" asks what that costs against
the best scheme at the same wire bytes. After the last step, at the next use of the weights,
every rank measures over the quantized elements of its own shards (groups of nonzero absmax;
the exact elements are the cast either way), relative to each group's absmax of the fp32
master: the error of the weights as written, of absmax/127's reference decode cast to the
working dtype (spec.py: the same bytes on the wire, the positive and negative absmax exact),
and of the master's plain cast (what an unquantized gather writes) -- the worst and the sum,
so the record can give the mean. It also counts the inputs DeepSpeed's fp16 staging changes
(zeropp.py): the master's working cast nonzero below fp16's normal range, or beyond its range.
Context for the reviewer, never a verdict; one pass of bounded pieces and one host
synchronisation per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qwz import shards as seam
from qwz.qualify.evidence import spec, zeropp
from qwz.qualify.run.observers.piecewise import piece_numel

_TOTALS = (
    "elements",
    "written_sum",
    "absmax127_sum",
    "cast_sum",
    "fp16_below_normal",
    "fp16_overflow",
)
_MAXIMA = ("written_worst", "absmax127_worst", "cast_worst")


def _piece(master, working, exact, group_size) -> torch.Tensor:
    """The piece's totals (:data:`_TOTALS`) then maxima (:data:`_MAXIMA`), float64."""
    dtype, numel = working.dtype, master.numel()
    values = torch.where(exact, torch.zeros_like(master), master)
    padded = torch.nn.functional.pad(values, (0, -numel % group_size))
    absmax = padded.view(-1, group_size).abs().amax(dim=1).repeat_interleave(group_size)[:numel]
    measured = ~exact & (absmax > 0)
    safe = torch.where(measured, absmax, torch.ones_like(absmax))

    def relative(decoded: torch.Tensor) -> torch.Tensor:
        error = (decoded.float() - master).abs() / safe
        return torch.where(measured, error, torch.zeros_like(error))

    written = relative(working)
    best = relative(spec.decode(values, group_size).to(dtype))
    cast = relative(master.to(dtype))
    below_normal, overflow = zeropp.staging_changes(master.to(dtype))
    return torch.stack(
        [
            measured.sum().double(),
            written.double().sum(),
            best.double().sum(),
            cast.double().sum(),
            (below_normal & ~exact).sum().double(),
            (overflow & ~exact).sum().double(),
            written.max().double(),
            best.max().double(),
            cast.max().double(),
        ]
    )


@torch.no_grad()
def measure(
    shards: Sequence[seam.OwnShard], exact: Sequence[torch.Tensor], group_size: int
) -> dict[str, Any]:
    """[Note: what a scheme costs] over every own shard of this rank: the totals
    (:data:`_TOTALS`), the maxima (:data:`_MAXIMA`) and the working dtype's name."""
    totals = torch.zeros(len(_TOTALS) + len(_MAXIMA), dtype=torch.float64)
    dtype = torch.float32
    for shard, mask in zip(shards, exact, strict=True):
        master = shard.master.detach().reshape(-1).float()
        working = shard.working.detach().reshape(-1)
        dtype = working.dtype
        numel = master.numel()
        step = piece_numel(master.device, group_size)
        shard_totals = torch.zeros_like(totals, device=master.device)
        for start in range(0, numel, step):
            end = min(start + step, numel)
            piece = _piece(master[start:end], working[start:end], mask[start:end], group_size)
            count = len(_TOTALS)
            shard_totals[:count] += piece[:count]
            shard_totals[count:] = torch.maximum(shard_totals[count:], piece[count:])
        shard_totals = shard_totals.cpu()  # one host synchronisation per shard
        totals[: len(_TOTALS)] += shard_totals[: len(_TOTALS)]
        totals[len(_TOTALS) :] = torch.maximum(totals[len(_TOTALS) :], shard_totals[len(_TOTALS) :])
    names = (*_TOTALS, *_MAXIMA)
    measured = {name: float(value) for name, value in zip(names, totals.tolist(), strict=True)}
    for name in ("elements", "fp16_below_normal", "fp16_overflow"):
        measured[name] = int(measured[name])
    measured["cast_dtype"] = str(dtype).removeprefix("torch.")
    return measured
