"""qwz.qualify.evidence.tolerance: the Adam update bound behind the (context-only) drift
bound, and the observers' own-shard check of a NaN decode."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz import quant
from qwz.qualify.evidence.tolerance import adam_update_bound
from qwz.qualify.run.observers import own_shard
from qwz.shards import ShardSlot, make_own_shard
from tests.unit.core.single_rank import floats

# --------------------------------------------------------------------------- #
# qwz.qualify.evidence.tolerance: [Note: parameter-sample tolerance]
# --------------------------------------------------------------------------- #


def betas_pairs() -> st.SearchStrategy[tuple[float, float]]:
    return st.one_of(
        st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.0, 0.999), (0.95, 0.9)]),
        # beta2 > 0: with beta2 == 0 the bound is infinite (v_hat is the last g**2 alone).
        st.tuples(floats(0.0, 0.999), floats(0.01, 0.9999)),
    )


@given(betas=betas_pairs())
def test_first_step_bound_is_one(betas):
    assert adam_update_bound(1, betas) == 1.0


def test_bound_is_nondecreasing_in_t_for_default_betas():
    bounds = [adam_update_bound(step, (0.9, 0.999)) for step in range(1, 20_001)]
    regressions = [t + 1 for t in range(len(bounds) - 1) if bounds[t + 1] < bounds[t]]
    assert not regressions, f"C_t decreases after steps {regressions[:5]}"


class GradientSequence(NamedTuple):
    gradients: list[float]
    betas: tuple[float, float]
    tight: bool
    """Built as Cauchy-Schwarz's equality case for the last step: its ratio is C_t."""


@st.composite
def gradient_sequences(draw) -> GradientSequence:
    betas = draw(betas_pairs())
    length = draw(st.integers(1, 60))
    if draw(st.booleans()):
        # g_k proportional to (b1 / b2) ** (t - k) makes m_hat / sqrt(v_hat) exactly C_t.
        beta1, beta2 = betas
        length = min(length, 20)  # (b1 / b2) ** t stays far from overflow
        ratio = beta1 / beta2
        if 0.0 < ratio < 1.0:
            # ... and from underflow: g**2 of the earliest gradient stays a normal float64
            # (a subnormal square loses the precision the equality relies on).
            length = min(length, 1 + int(140 / -math.log10(ratio)))
        scale = draw(floats(1e-3, 1e3)) * draw(st.sampled_from([-1.0, 1.0]))
        if beta1 == 0.0:
            gradients = [0.0] * (length - 1) + [scale]
        else:
            gradients = [scale * (beta1 / beta2) ** (length - k) for k in range(1, length + 1)]
        return GradientSequence(gradients, betas, True)
    # 0, or sign * [1, 10) * 10**e with e in [-30, 6]: g**2 never under- or overflows.
    magnitudes = st.one_of(
        st.just(0.0),
        st.builds(
            lambda sign, mantissa, exponent: sign * mantissa * 10.0**exponent,
            st.sampled_from([-1.0, 1.0]),
            floats(1.0, 10.0),
            st.integers(-30, 6),
        ),
    )
    return GradientSequence(
        draw(st.lists(magnitudes, min_size=length, max_size=length)), betas, False
    )


@given(case=gradient_sequences())
def test_bound_holds_for_adam_moments(case):
    """Adam's bias-corrected moments (eps = 0) computed directly in float64."""
    beta1, beta2 = case.betas
    m = v = 0.0
    ratio = 0.0
    for step, gradient in enumerate(case.gradients, start=1):
        m = beta1 * m + (1 - beta1) * gradient
        v = beta2 * v + (1 - beta2) * gradient * gradient
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        ratio = abs(m_hat) / math.sqrt(v_hat) if v_hat > 0 else 0.0
        bound = adam_update_bound(step, case.betas)
        assert ratio <= bound * (1 + 1e-9), f"step {step}: |m_hat|/sqrt(v_hat) {ratio} > {bound}"
    if case.tight:
        bound = adam_update_bound(len(case.gradients), case.betas)
        assert ratio >= bound * (1 - 1e-9), f"equality case reaches {ratio}, not C_t {bound}"


# --------------------------------------------------------------------------- #
# the observers' own-shard check: a NaN decode
# --------------------------------------------------------------------------- #


def decoded(master: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    q = quant.quantize(master, group_size)
    return quant.dequantize(q, dtype)


def test_a_nan_decode_is_a_violation_in_the_observers():
    master = torch.linspace(1.0, 2.0, 128)
    working = decoded(master, 64, torch.bfloat16)
    working[3] = math.nan
    shard = make_own_shard("s", master, working, 64, None, [ShardSlot("w", 0, 128, 0)])
    result = own_shard.OwnShardResult()
    own_shard.check_own_shards([shard], [torch.zeros(128, dtype=torch.bool)], 64, 1, 0, result)
    assert result.max_ratio == math.inf
    assert result.first_violation is not None and result.first_violation["index"] == 3
