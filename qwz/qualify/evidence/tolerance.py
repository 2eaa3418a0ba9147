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
runs only catches gross errors after the first steps: it is context for the
report and a bound the engine's multi-rank tests assert. The tight check is
``own-shard``: every rank's own shard against the contract's decodes of its own
fp32 master at every step ([Note: the contract and its freedoms], spec.py),
which catches a wrong scale, group, chunk or owner whenever it happens.
"""

from __future__ import annotations

import math

import torch

from qwz.qualify.evidence.spec import half_ulp


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
