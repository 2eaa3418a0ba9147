"""What a piece outside the contract is nearest to, said in a sentence (the rare path).

[Note: naming a near miss]
"Not a decode the contract allows" tells a reviewer nothing about what to fix. When the
own-shard check finds mismatches ([Note: own shard against the spec], own_shard.py), the
first mismatching piece is weighed once more: under each scheme of the contract, how many of
its elements the best choice per group gives (the scheme that gives the most came nearest),
and under each named near miss (:data:`contract.NEAR_MISSES`: another divisor, floor codes,
DeepSpeed's arithmetic without its clamp or with its scale not inverted, no quantization at
all), how many of the mismatching elements it writes exactly, from the fp32 master or from
its cast to the working dtype. The sentence names the nearest scheme and the near miss that
explains the most mismatches, with how many; it never changes the verdict.
"""

from __future__ import annotations

import torch

from qwz.qualify.evidence import contract


def _scheme_reach(master, working, exact, group_size, scheme) -> int:
    """Elements of the piece the best choice of `scheme` per group gives."""
    dtype, numel = working.dtype, master.numel()
    cast = master.to(dtype)
    best = torch.zeros(-(-numel // group_size), dtype=torch.long, device=master.device)
    for choice in contract.choices(scheme, master, exact, group_size, dtype):
        given = torch.zeros_like(exact)
        for value in choice.values:
            given |= working == torch.where(exact, cast, value.to(dtype))
        padded = torch.nn.functional.pad(given, (0, -numel % group_size))
        best = torch.maximum(best, padded.view(-1, group_size).sum(dim=1))
    return int(best.sum())


def _explained(master, working, exact, group_size, mismatch, near_miss) -> int:
    """Mismatching elements `near_miss` writes exactly, from the master or its working cast
    (the better of the two)."""
    dtype = working.dtype
    most = 0
    for values in (master, master.to(dtype).float()):
        decoded = near_miss.decode(torch.where(exact, torch.zeros_like(values), values), group_size)
        most = max(most, int((mismatch & (working == decoded.to(dtype))).sum()))
    return most


def diagnose(master, working, exact, group_size, mismatch) -> str:
    """[Note: naming a near miss] for one piece (fp32 `master`, `working`, bool `exact` and
    `mismatch`, all (n,))."""
    numel, wrong = master.numel(), int(mismatch.sum())
    reach = {
        scheme: _scheme_reach(master, working, exact, group_size, scheme)
        for scheme in contract.SCHEMES
    }
    nearest = max(reach, key=reach.get)
    said = (
        f"nearest scheme: {contract.SCHEME_SHORT[nearest]} (its choices give "
        f"{reach[nearest]} of the {numel} elements from the first mismatching group on)"
    )
    explained = [
        (_explained(master, working, exact, group_size, mismatch, item), item.what)
        for item in contract.NEAR_MISSES
    ]
    count, what = max(explained, key=lambda pair: pair[0])
    if count == 0:
        return f"{said}; no named near miss explains the {wrong} mismatching elements there"
    share = "every one" if count == wrong else f"{count}"
    return f"{said}; {share} of the {wrong} mismatching elements there is {what}"
