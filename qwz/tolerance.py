"""How far a quantized run may drift from its unquantized reference: the parameter-sample bound.

[Note: parameter-sample tolerance]
Two runs -- reference (gather unquantized) and candidate (gather quantized) --
start from bit-identical weights and take the same optimizer steps on their
own gradients. Let ``r_t`` and ``q_t`` be their fp32 master values of one
element after step ``t``.

Adam(W) moves an element by ``lr * u_t`` (plus a decoupled decay factor
``1 - lr * wd`` that only shrinks differences), and for any gradient
sequence ``|u_t| <= |m_hat_t| / sqrt(v_hat_t) <= C_t`` with (Cauchy-Schwarz
on the two exponential moving averages)::

    C_t = (1 - b1) / (1 - b1**t) * sqrt((1 - b2**t) / (1 - b2))
          * sqrt(sum_{k<t} (b1**2 / b2)**k)                  # C_1 = 1

so ``|q_t - r_t| <= D_t = 2 * lr * sum_{k<=t} C_k``. The working copies add
their own error: the reference casts ``r_t`` to the working dtype (half an
ulp), the candidate decodes ``q_t`` to within ``scale / 2`` of its group
([Note: quantization math] in quant.py) and then casts (half an ulp). So for
every sampled element::

    |w_q - w_r| <= D_t + scale / 2 + ulp(|w_r|) + ulp(|w_q|) + tiny

The bound depends only on the learning rate, the betas, the step and the
group's scale, so a violation is never noise. But the drift term grows with the
step (2e-3 after one step at lr 1e-3, 0.04 after 20), so this comparison of two
runs only catches gross errors after the first steps. The tight check is
:func:`own_shard_decode_ratio`: every rank's own shard against its own fp32
master, which allows ``scale / 2`` (plus the cast) at every step, and catches a
wrong scale, group, chunk or owner whenever it happens.
"""

from __future__ import annotations

import math

import torch


def adam_update_bound(step: int, betas: tuple[float, float]) -> float:
    """C_t: the largest |m_hat / sqrt(v_hat)| Adam can produce at `step` (1-based)."""
    beta1, beta2 = betas
    if step < 1:
        raise ValueError(f"step: {step} is invalid: steps are counted from 1")
    if beta2 == 0.0:
        return math.inf  # v_hat is the last squared gradient alone: no bound exists
    ratio = beta1 * beta1 / beta2
    series = float(step) if ratio == 1.0 else (1.0 - ratio**step) / (1.0 - ratio)
    return (
        (1.0 - beta1)
        / (1.0 - beta1**step)
        * math.sqrt((1.0 - beta2**step) / (1.0 - beta2))
        * math.sqrt(series)
    )


def master_drift_bound(step: int, lr: float, betas: tuple[float, float]) -> float:
    """D_t = 2 * lr * sum of C_k for k = 1..step; 0 before the first step."""
    return 2.0 * lr * sum(adam_update_bound(k, betas) for k in range(1, step + 1))


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` at |values| (fp32 tensor): the error of one rounding cast."""
    mantissa_bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.clamp(values.abs(), min=tiny) * 2.0 ** (-mantissa_bits - 1)


def element_bound(
    step: int,
    lr: float,
    betas: tuple[float, float],
    scales: torch.Tensor,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per-element bound on |candidate - reference| after `step` steps (fp32 tensor); see
    [Note: parameter-sample tolerance].

    `scales` is the quantization scale of each candidate element's group (0 for
    elements that travel exactly)."""
    reference = reference.float()
    candidate = candidate.float()
    rounding = half_ulp(reference, dtype) + half_ulp(candidate, dtype)
    arithmetic = 4 * torch.finfo(torch.float32).eps * (reference.abs() + candidate.abs())
    return master_drift_bound(step, lr, betas) + scales.float() / 2 + rounding + arithmetic


def own_shard_decode_check(
    master: torch.Tensor,
    working: torch.Tensor,
    group_size: int,
    exact: torch.Tensor | None = None,
) -> tuple[float, int]:
    """The tight check: how far a rank's working copy of its *own* shard is from what the
    gather must write there, relative to what [Note: quantization math] allows.

    master: (n,) fp32 master shard; working: (n,) the working copy of the same elements.
    Elements flagged in `exact` (bool, (n,)) must equal the master cast to the working dtype
    bit for bit (inf when one does not); the others must be within ``scale / 2`` of the
    master plus ``DECODE_ERROR_SLACK * scale`` (the kernels' rounding, [Note: quantization
    math]) plus the cast's half-ulp, with each group's scale computed from the master itself
    by the quantizer's own formula (exact elements zeroed, as they do not travel in the
    quantized stream). Returns ``(worst error / bound, its position)``: <= 1 when the gather
    is right; (0.0, 0) for an empty shard.

    Unlike the drift bound, this needs no reference run and does not loosen with steps: a
    wrong scale, group, chunk or owner shows up at any step."""
    master = master.detach().float().reshape(-1)
    working = working.detach().reshape(-1)
    numel = master.numel()
    if working.numel() != numel or (exact is not None and exact.numel() != numel):
        raise ValueError(
            f"working ({working.numel()} elements) and exact "
            f"({None if exact is None else exact.numel()}) must match the master ({numel})"
        )
    if numel == 0:
        return 0.0, 0
    exact = torch.zeros_like(master, dtype=torch.bool) if exact is None else exact.reshape(-1)
    # On CPU whole groups at a time, about CHECK_CHUNK_NUMEL elements, so the temporaries
    # stay in cache (the check runs on every rank after every step of every arm); on other
    # devices in one piece (each piece costs host synchronisations).
    if master.device.type == "cpu":
        step = max(1, CHECK_CHUNK_NUMEL // group_size) * group_size
    else:
        step = numel
    pieces = [(start, min(start + step, numel)) for start in range(0, numel, step)]
    for start, end in pieces:  # an exact element that differs fails first, wherever it is
        cast = master[start:end].to(working.dtype)
        mismatch = exact[start:end] & (working[start:end] != cast)
        if bool(mismatch.any()):
            return math.inf, start + int(mismatch.nonzero()[0])
    worst, worst_position = 0.0, 0
    for start, end in pieces:
        ratio, position = _own_piece_ratio(
            master[start:end], working[start:end], group_size, exact[start:end]
        )
        # The first NaN wins, as argmax over the whole shard would have it.
        if ratio > worst or (math.isnan(ratio) and not math.isnan(worst)):
            worst, worst_position = ratio, start + position
    return worst, worst_position


CHECK_CHUNK_NUMEL = 1 << 16
"""Elements per piece of :func:`own_shard_decode_check` on CPU (rounded to whole groups)."""


def _own_piece_ratio(
    master: torch.Tensor, working: torch.Tensor, group_size: int, exact: torch.Tensor
) -> tuple[float, int]:
    """The worst error / bound of whole groups (the last may be partial), and its position.
    An element decoded without error scores 0 even where its bound is 0 (a zero group with
    an fp32 working copy, whose half-ulp at 0 underflows): 0 / 0 must not become a NaN that
    outranks a real violation. A NaN element (a NaN decode) scores NaN."""
    from qwz.quant import DECODE_ERROR_SLACK
    from qwz.shards import shard_scales

    scales = shard_scales(master, group_size, exact)  # (num_groups,)
    half_scale = (scales / 2).repeat_interleave(group_size)[: master.numel()]
    slack = (DECODE_ERROR_SLACK * scales).repeat_interleave(group_size)[: master.numel()]
    # The cast rounds the decoded value, which may sit in the binade above the master's.
    magnitude = torch.maximum(master.abs(), working.float().abs())
    bound = half_scale + half_ulp(magnitude, working.dtype) + slack
    error = (working.float() - master).abs()
    ratio = torch.where(exact | (error == 0), torch.zeros_like(error), error / bound)
    position = int(ratio.argmax())
    return float(ratio[position]), position


def own_shard_decode_ratio(
    master: torch.Tensor,
    working: torch.Tensor,
    group_size: int,
    exact: torch.Tensor | None = None,
) -> float:
    """The worst ratio of :func:`own_shard_decode_check`."""
    return own_shard_decode_check(master, working, group_size, exact)[0]
