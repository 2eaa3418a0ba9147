"""qwz.tolerance: the Adam update bound behind the (context-only) drift bound, and the
own-shard decode check the qualification runs after every step."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz import quant
from qwz.qualify.run import observers
from qwz.shards import ShardSlot, make_own_shard
from qwz.tolerance import CHECK_CHUNK_NUMEL, adam_update_bound, half_ulp, own_shard_decode_check

from .single_rank import floats

# --------------------------------------------------------------------------- #
# qwz.tolerance: [Note: parameter-sample tolerance]
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
# qwz.tolerance.own_shard_decode_check: pieces give the whole-shard answer
# --------------------------------------------------------------------------- #


def whole_shard_check(master, working, group_size, exact):
    """The check over the whole shard at once, as its docstring states it."""
    master, working = master.float(), working
    mismatch = exact & (working != master.to(working.dtype))
    if bool(mismatch.any()):
        return math.inf, int(mismatch.nonzero()[0])
    zeroed = torch.where(exact, torch.zeros_like(master), master)
    scales = quant.group_scales(zeroed, group_size).repeat_interleave(group_size)[: master.numel()]
    magnitude = torch.maximum(master.abs(), working.float().abs())
    bound = scales / 2 + half_ulp(magnitude, working.dtype) + quant.DECODE_ERROR_SLACK * scales
    error = (working.float() - master).abs()
    ratio = torch.where(exact | (error == 0), torch.zeros_like(error), error / bound)
    position = int(ratio.argmax())
    return float(ratio[position]), position


def decoded(master: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    q = quant.quantize(master, group_size)
    return quant.dequantize(q, dtype)


@pytest.mark.parametrize(
    ("numel", "group_size"),
    [(CHECK_CHUNK_NUMEL * 3 + 70, 64), (CHECK_CHUNK_NUMEL + 5, 100), (3 * 70_000 + 1, 70_000)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_give_the_whole_shard_answer(numel, group_size, dtype):
    """Across piece boundaries, with groups larger than a piece, a partial last group,
    exact elements, zero groups and one planted violation (the worst, and ties)."""
    generator = torch.Generator().manual_seed(numel)
    master = torch.randn(numel, generator=generator)
    master[group_size : 2 * group_size] = 0.0
    exact = torch.rand(numel, generator=generator) < 0.01
    working = torch.where(exact, master.to(dtype), decoded(master, group_size, dtype))
    assert own_shard_decode_check(master, working, group_size, exact) == whole_shard_check(
        master, working, group_size, exact
    )
    for at in (numel - 1, CHECK_CHUNK_NUMEL + 1, 7):
        bad = working.clone()
        bad[at] = (bad[at].float() + 3.0).to(dtype) if not exact[at] else bad[at]
        expected = whole_shard_check(master, bad, group_size, exact)
        assert own_shard_decode_check(master, bad, group_size, exact) == expected


def test_an_exact_mismatch_anywhere_outranks_a_nan_earlier():
    """The exact rule fails first, as over the whole shard: a NaN decode in the first piece
    does not hide a differing exact element in a later one."""
    numel = 3 * CHECK_CHUNK_NUMEL
    master = torch.linspace(-1.0, 1.0, numel)
    exact = torch.zeros(numel, dtype=torch.bool)
    exact[-10:] = True
    working = decoded(master, 64, torch.bfloat16)
    working[-10:] = master[-10:].to(torch.bfloat16)
    working[5] = math.nan
    working[-3] += 1.0
    assert own_shard_decode_check(master, working, 64, exact) == (math.inf, numel - 3)


def test_a_zero_group_with_an_fp32_working_copy_hides_no_violation():
    """A zero group's bound is 0 in fp32 (the half-ulp at 0 underflows): 0 / 0 must not turn
    into a NaN that outranks a real violation elsewhere."""
    master = torch.cat([torch.zeros(64), torch.linspace(1.0, 2.0, 64)])
    working = decoded(master, 64, torch.float32)
    working[100] *= 1.5
    ratio, position = own_shard_decode_check(master, working, 64)
    assert position == 100 and ratio > 1.0


def test_a_nan_decode_is_a_violation_in_the_observers():
    master = torch.linspace(1.0, 2.0, 128)
    working = decoded(master, 64, torch.bfloat16)
    working[3] = math.nan
    shard = make_own_shard("s", master, working, 64, None, [ShardSlot("w", 0, 128, 0)])
    result = observers.OwnShardResult()
    observers.check_own_shards([shard], [torch.zeros(128, dtype=torch.bool)], 64, 1, 0, result)
    assert result.max_ratio == math.inf
    assert result.first_violation is not None and result.first_violation["index"] == 3


def test_shards_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"must match the master \(10\)"):
        own_shard_decode_check(torch.zeros(10), torch.zeros(12), 4)
    with pytest.raises(ValueError, match="must match the master"):
        own_shard_decode_check(torch.zeros(10), torch.zeros(10), 4, torch.zeros(9, dtype=bool))
