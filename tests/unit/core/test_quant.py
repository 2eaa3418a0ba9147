"""Properties of group-wise int8 quantization: DESIGN.md "Quantization" and
[Note: quantization math] in ``qwz/quant.py``.

Exact comparisons throughout (``torch.equal``, or a bound derived below); the reference
implementation is plain numpy float32, written independently of the code under test.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qwz
from qwz import kernels as wire_kernels
from qwz import quant
from qwz.kernels import EAGER_KERNELS
from qwz.kernels.fused import FusedDecode, FusedEncode, FusedKernel
from qwz.quant import (
    DECODE_ERROR_SLACK,
    WireRow,
    dequantize_groups,
    group_scales,
    quantize_groups,
    row_codes,
    row_scales,
    scale_from_absmax,
)

from ..strategies import (
    FLOAT_DTYPES,
    poisoned,
    tensor_and_group_size,
    tensors,
)

INT8_MAX = 127


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """pytest-xdist already runs one worker per core; torch's intra-op threads on top of
    that oversubscribe the cores and make every op past 32k elements wait on a spinning
    thread (10x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# [Error bound slack] The bound |x_hat - x| <= scale/2 holds in exact arithmetic. The
# kernel multiplies by the fp32 reciprocal of the scale (unit roundoff u = 2**-24):
# t = fl(x * fl(1 / scale)) is off x/scale by <= 127 * (2u + u**2) steps, so the code may
# round the other way within that distance of a half-integer; x_hat = fl(code * scale) is
# off code*scale by <= 127u*scale. So |x_hat - x| <= scale * (1/2 + 381u + 127u**2) <
# scale * (1/2 + 2**-15). A scale of absmax/128 (the upstream bug) misses by a whole step.
BOUND_SLACK = 2.0**-15


def test_the_kernels_stated_slack_covers_the_derived_one():
    unit_roundoff = 2.0**-24
    assert 381 * unit_roundoff + 127 * unit_roundoff**2 <= DECODE_ERROR_SLACK
    assert BOUND_SLACK >= DECODE_ERROR_SLACK


def flat_groups(x: torch.Tensor, group_size: int) -> np.ndarray:
    """x flattened to fp32 (exact for bf16/fp16), zero-padded, as (num_groups, group_size)."""
    flat = x.detach().reshape(-1).to(torch.float32).numpy()
    num_groups = -(-flat.size // group_size)
    padded = np.zeros(num_groups * group_size, dtype=np.float32)
    padded[: flat.size] = flat
    return padded.reshape(num_groups, group_size)


def reference_quantize(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DESIGN.md math in plain numpy float32: scale = absmax / 127,
    code = rint(x * (1 / scale)) (the reciprocal of [Note: quantization math])."""
    groups = flat_groups(x, group_size)
    absmax = np.abs(groups).max(axis=1, initial=np.float32(0))
    scales = absmax / np.float32(INT8_MAX)
    assert scales.dtype == np.float32
    with np.errstate(invalid="ignore", divide="ignore"):
        inverse = np.float32(1) / np.where(scales == 0, np.float32(1), scales)
        codes = np.rint(groups * inverse[:, None])
    return torch.from_numpy(codes.astype(np.int64)), torch.from_numpy(scales)


def element_scales(q: qwz.QuantizedTensor) -> torch.Tensor:
    """The scale of each element's group, float64, (numel,)."""
    return q.scales.double().repeat_interleave(q.codes.shape[1])[: q.numel]


def error_over_step(x: torch.Tensor, q: qwz.QuantizedTensor, x_hat: torch.Tensor) -> torch.Tensor:
    """|x_hat - x| / scale per element, in float64 (exact for fp32 operands)."""
    error = (x_hat.double().reshape(-1) - x.double().reshape(-1)).abs()
    scales = element_scales(q)
    # Where the scale is 0 only an exact decode (error 0) is within the bound.
    exact_or_inf = torch.where(error == 0, 0.0, math.inf).to(torch.float64)
    return torch.where(scales > 0, error / scales, exact_or_inf)


def codes_in_range(codes: torch.Tensor) -> bool:
    return bool(((codes >= -INT8_MAX) & (codes <= INT8_MAX)).all())


def assert_within_half_step(x: torch.Tensor, q: qwz.QuantizedTensor, slack: float = BOUND_SLACK):
    x_hat = qwz.dequantize(q, torch.float32)
    assert x_hat.dtype == torch.float32
    ratio = error_over_step(x, q, x_hat)
    worst = ratio.max().item() if ratio.numel() else 0.0
    assert worst <= 0.5 + slack, f"error {worst} steps > 1/2"


# --------------------------------------------------------------------------- #
# Error bound and the exact math
# --------------------------------------------------------------------------- #


@given(case=tensor_and_group_size())
def test_error_is_at_most_half_a_step(case):
    """fp32/bf16/fp16, magnitudes 2**-20 .. 2**30 (fp16: its range), any shape."""
    x, group_size = case
    assert_within_half_step(x, qwz.quantize(x, group_size))


@given(case=tensor_and_group_size(ragged=True))
def test_ragged_tail_is_zero_padded_and_within_bound(case):
    x, group_size = case
    assert x.numel() % group_size != 0
    q = qwz.quantize(x, group_size)
    assert q.codes.shape == (x.numel() // group_size + 1, group_size)
    padding = q.codes.reshape(-1)[x.numel() :]
    assert torch.equal(padding, torch.zeros_like(padding))
    assert_within_half_step(x, q)


@given(case=tensor_and_group_size())
def test_codes_and_scales_match_a_plain_reference(case):
    x, group_size = case
    q = qwz.quantize(x, group_size)
    codes, scales = reference_quantize(x, group_size)
    assert torch.equal(q.scales, scales)  # scale == absmax / 127, bit for bit
    assert torch.equal(q.codes.to(torch.int64), codes)
    assert codes_in_range(q.codes)


@given(case=tensor_and_group_size())
def test_absmax_maps_to_plus_or_minus_127(case):
    x, group_size = case
    q = qwz.quantize(x, group_size)
    groups = torch.from_numpy(flat_groups(x, group_size))
    absmax = groups.abs().amax(dim=1, keepdim=True)
    at_absmax = (groups.abs() == absmax) & (absmax > 0)
    expected = torch.sign(groups).to(torch.int8) * INT8_MAX
    assert torch.equal(q.codes[at_absmax], expected[at_absmax])
    assert torch.equal(at_absmax.any(dim=1), q.scales > 0)


@given(case=tensor_and_group_size(), data=st.data())
def test_all_zero_groups_have_zero_scale_and_decode_to_exact_zeros(case, data):
    x, group_size = case
    flat = x.reshape(-1).clone()
    num_groups = -(-flat.numel() // group_size)
    zeroed = data.draw(st.sets(st.integers(0, max(0, num_groups - 1)), max_size=num_groups))
    for group in zeroed:
        flat[group * group_size : (group + 1) * group_size] = 0.0
    q = qwz.quantize(flat.reshape(x.shape), group_size)
    for group in zeroed:
        assert q.scales[group].item() == 0.0
        assert torch.equal(q.codes[group], torch.zeros_like(q.codes[group]))
    for dtype in (None, torch.float32):
        decoded = qwz.dequantize(q, dtype).reshape(-1)
        for group in zeroed:
            part = decoded[group * group_size : (group + 1) * group_size]
            assert torch.equal(part, torch.zeros_like(part))


@given(case=tensor_and_group_size())
def test_zeros_stay_exact_zeros(case):
    x, group_size = case
    q = qwz.quantize(x, group_size)
    is_zero = x == 0
    for dtype in (None, torch.float32):
        decoded = qwz.dequantize(q, dtype)
        assert torch.equal(decoded[is_zero], torch.zeros_like(decoded[is_zero]))


# --------------------------------------------------------------------------- #
# Structure: shapes, dtypes, determinism, idempotence
# --------------------------------------------------------------------------- #


@given(case=tensor_and_group_size(), out_dtype=st.sampled_from(FLOAT_DTYPES))
def test_shape_and_dtype_are_restored_and_dtype_override_works(case, out_dtype):
    x, group_size = case
    q = qwz.quantize(x, group_size)
    num_groups = -(-x.numel() // group_size)
    assert (q.shape, q.dtype, q.numel) == (x.shape, x.dtype, x.numel())
    assert (q.codes.dtype, q.codes.shape) == (torch.int8, (num_groups, group_size))
    assert (q.scales.dtype, q.scales.shape) == (torch.float32, (num_groups,))
    restored = qwz.dequantize(q)
    assert (restored.shape, restored.dtype) == (x.shape, x.dtype)
    as_fp32 = qwz.dequantize(q, torch.float32)
    overridden = qwz.dequantize(q, out_dtype)
    assert (overridden.shape, overridden.dtype) == (x.shape, out_dtype)
    # The override is the fp32 decode cast once, nothing else.
    assert torch.equal(overridden, as_fp32.to(out_dtype))
    assert torch.equal(restored, as_fp32.to(x.dtype))


@given(case=tensor_and_group_size())
def test_quantize_is_deterministic(case):
    x, group_size = case
    first, second = qwz.quantize(x, group_size), qwz.quantize(x.clone(), group_size)
    assert torch.equal(first.codes, second.codes)
    assert torch.equal(first.scales, second.scales)


@given(case=tensor_and_group_size())
def test_quantize_is_idempotent(case):
    x, group_size = case
    q = qwz.quantize(x, group_size)
    again = qwz.quantize(qwz.dequantize(q, torch.float32), group_size)
    assert torch.equal(again.codes, q.codes)
    assert torch.equal(again.scales, q.scales)


@given(case=tensor_and_group_size(dtypes=(torch.float32,)))
def test_flat_primitives_are_what_quantize_uses(case):
    x, group_size = case
    groups = torch.from_numpy(flat_groups(x, group_size))  # (num_groups, group_size)
    codes, scales = quantize_groups(groups)
    ref_codes, ref_scales = reference_quantize(x, group_size)
    assert torch.equal(codes.to(torch.int64), ref_codes)
    assert torch.equal(scales, ref_scales)
    q = qwz.quantize(x, group_size)
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.scales, scales)
    for dtype in FLOAT_DTYPES:
        decoded = dequantize_groups(codes, scales, dtype)
        assert torch.equal(decoded, (codes.to(torch.float32) * scales[:, None]).to(dtype))


# --------------------------------------------------------------------------- #
# Range: bf16 beyond fp16, non-finite input
# --------------------------------------------------------------------------- #


@st.composite
def bf16_beyond_fp16_range(draw) -> tuple[torch.Tensor, int]:
    """bf16 tensors with magnitudes up to 2**116 (< 1e35), at least one above 65504."""
    x, group_size = draw(
        tensor_and_group_size(dtypes=(torch.bfloat16,), ragged=True, exponents=(-20, 115))
    )
    big = draw(st.floats(2.0**17, 1e35))
    flat = x.reshape(-1).clone()
    flat[draw(st.integers(0, flat.numel() - 1))] = big * draw(st.sampled_from([-1, 1]))
    return flat.reshape(x.shape), group_size


@given(case=bf16_beyond_fp16_range())
def test_bf16_beyond_the_fp16_range_round_trips_finitely(case):
    """Regression: the upstream kernel staged bf16 through fp16, so |x| > 65504 became inf."""
    x, group_size = case
    assert x.float().abs().max() > torch.finfo(torch.float16).max
    q = qwz.quantize(x, group_size)
    assert torch.isfinite(q.scales).all()
    assert torch.isfinite(qwz.dequantize(q)).all()
    assert torch.isfinite(qwz.dequantize(q, torch.float32)).all()
    assert_within_half_step(x, q)


@given(case=poisoned())
def test_non_finite_groups_decode_non_finite_and_spare_the_others(case):
    clean, x, group_size, bad_groups = case
    q = qwz.quantize(x, group_size)
    assert codes_in_range(q.codes)
    decoded = qwz.dequantize(q, torch.float32).reshape(-1)
    expected = qwz.quantize(clean, group_size)
    good = torch.ones(q.codes.shape[0], dtype=torch.bool)
    good[bad_groups] = False
    numel = x.numel()
    for group in bad_groups:
        part = decoded[group * group_size : min(numel, (group + 1) * group_size)]
        assert not torch.isfinite(part).any()
    # The other groups are exactly what the clean tensor gives, hence within bound.
    assert torch.equal(q.codes[good], expected.codes[good])
    assert torch.equal(q.scales[good], expected.scales[good])
    element_good = good.repeat_interleave(group_size)[:numel]
    assert torch.isfinite(decoded[element_good]).all()
    ratio = error_over_step(clean, q, decoded)[element_good]
    assert bool((ratio <= 0.5 + BOUND_SLACK).all())


# --------------------------------------------------------------------------- #
# Signal-to-quantization-noise ratio
# --------------------------------------------------------------------------- #

SQNR_NUMEL = 1 << 16


@functools.cache
def expected_max_squared(group_size: int) -> float:
    """E[M**2] for M the largest |z| of `group_size` standard normals (numerical integral)."""
    m = torch.linspace(0.0, 14.0, 200_001, dtype=torch.float64)
    cdf = torch.erf(m / math.sqrt(2.0)) ** group_size  # P(M <= m)
    return torch.trapezoid(2.0 * m * (1.0 - cdf), m).item()  # E[M^2] = int 2m P(M > m) dm


def predicted_sqnr_db(group_size: int) -> float:
    g = group_size
    return 10.0 * math.log10(12.0 * INT8_MAX**2 / expected_max_squared(g) * g / (g - 1))


def measured_sqnr_db(x: torch.Tensor, group_size: int) -> float:
    x_hat = qwz.dequantize(qwz.quantize(x, group_size), torch.float32)
    signal = x.double().square().sum()
    noise = (x_hat.double() - x.double()).square().sum()
    return 10.0 * math.log10((signal / noise).item())


@st.composite
def gaussian(draw) -> torch.Tensor:
    sigma = 2.0 ** draw(st.integers(-20, 20))  # SQNR is scale-free
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    return torch.randn(SQNR_NUMEL, generator=generator) * sigma


@given(x=gaussian(), group_size=st.sampled_from([8, 64, 512]))
def test_sqnr_on_gaussian_data_matches_the_derivation(x, group_size):
    """SQNR of N(0, sigma^2) data, derived, with a floor of 40 dB at G = 64.

    In a group of G elements the step is s = M / 127, with M the group's absmax. For
    s << sigma the rounding error of each element is uniform on [-s/2, s/2], of power
    s^2 / 12, except the absmax element itself, which is exact; so the noise power per
    element is (G-1)/G * E[M^2] / (12 * 127^2) and

        SQNR = 10 log10( sigma^2 / noise ) = 10 log10( 12 * 127^2 * G / ((G-1) E[M^2]/sigma^2) ).

    With M the max of G half-normals, E[M^2]/sigma^2 = int_0^inf 2m (1 - erf(m/sqrt2)^G) dm
    = 3.46, 6.91, 10.68 for G = 8, 64, 512 (E[M] = 1.78, 2.60, 3.25 sigma), giving
    48.1, 44.5, 42.6 dB (G = 8192 would give 40.9). int8 at G = 64 is therefore about
    44.5 dB, and a measurement below 40 dB there would be a real regression (a lost bit,
    a coarser step). With 2**16 samples (>= 128 groups) the estimate's standard error is
    below 0.1 dB, so the measurement must land within 0.5 dB of the prediction.
    """
    predicted = predicted_sqnr_db(group_size)
    measured = measured_sqnr_db(x, group_size)
    assert abs(measured - predicted) <= 0.5, (measured, predicted)
    if group_size == 64:
        assert 44.0 <= predicted <= 45.0
        assert measured >= 40.0


@given(x=gaussian(), small=st.integers(1, 32), factor=st.sampled_from([2, 4]))
def test_larger_groups_give_lower_sqnr(x, small, factor):
    """A larger group shares one step across a larger absmax, so more noise (same data).

    G <= 1024 keeps >= 64 groups; the smallest gap (512 -> 1024, about 0.5 dB) is more
    than five standard errors of the difference."""
    small_group = 8 * small  # 8 .. 256
    assert measured_sqnr_db(x, small_group) > measured_sqnr_db(x, small_group * factor)


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("group_size", [0, -1, -64, True, False, 64.0, 8.5, "64", None])
def test_invalid_group_size_raises_value_error(group_size):
    with pytest.raises(ValueError, match="group_size"):
        qwz.quantize(torch.ones(128), group_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.int32])
def test_unsupported_input_dtype_raises_value_error(dtype):
    with pytest.raises(ValueError, match="dtype"):
        qwz.quantize(torch.ones(128, dtype=dtype))


# --------------------------------------------------------------------------- #
# Compiled kernels
# --------------------------------------------------------------------------- #


@st.composite
def wire_rows(draw):
    """Values for one wire row: whole groups or a partial last group, any magnitudes
    (zeros, tiny, huge, poisoned groups), and the working dtype to decode into. Sizes are
    few and fixed so compile(dynamic=False) compiles a handful of shapes."""
    group_size = draw(st.sampled_from([8, 64]))
    num_groups = draw(st.sampled_from([1, 3, 40]))
    numel = num_groups * group_size - draw(st.sampled_from([0, 5]))
    x = draw(tensors(max(numel, 1), torch.float32)).reshape(-1)[:numel]
    if numel and draw(st.booleans()):  # a poisoned group decodes non-finite, the same way
        x = x.clone()
        x[draw(st.integers(0, numel - 1))] = draw(st.sampled_from([math.nan, math.inf]))
    return x, group_size, num_groups, draw(st.sampled_from(FLOAT_DTYPES))


def encode_decode(kernels, values, group_size, num_groups, dtype):
    row = WireRow(num_groups, group_size, 0, 4)
    rows = torch.zeros(2, row.row_bytes, dtype=torch.uint8)
    kernels.encode(values, row_scales(rows, row)[1], row_codes(rows, row)[1])
    decoded = torch.zeros(2, values.numel(), dtype=dtype)
    kernels.decode(row_scales(rows, row), row_codes(rows, row), decoded)
    return rows, decoded


@pytest.fixture(scope="module")
def fresh_fused_kernels():
    """Fused kernels of their own, compiled from a clean dynamo cache: the property compiles
    a few dozen shapes, and other tests in this worker process may have compiled others
    before (the process-wide kernels then fall back to eager at the recompile limit, which
    would make the comparison eager against eager)."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield wire_kernels.QuantKernels("fused", FusedEncode(), FusedDecode())
    torch._dynamo.reset()


@pytest.mark.slow
@given(case=wire_rows())
def test_fused_and_eager_kernels_produce_the_same_bytes(case, fresh_fused_kernels):
    """Ranks may not diverge by kernel choice: the same wire row and the same decode."""
    values, group_size, num_groups, dtype = case
    fused = fresh_fused_kernels
    eager_rows, eager_decoded = encode_decode(EAGER_KERNELS, values, group_size, num_groups, dtype)
    rows, decoded = encode_decode(fused, values, group_size, num_groups, dtype)
    assert fused.encode.fallback is None and fused.decode.fallback is None
    assert torch.equal(rows, eager_rows)
    # The decode: the same bytes wherever it is a number. A poisoned group decodes to NaN at
    # the same positions, but the cast of NaN to bf16/fp16 may pick another NaN payload
    # (the wire bytes above are identical; the engine refuses to gather such a group).
    nan = torch.isnan(decoded)
    assert torch.equal(nan, torch.isnan(eager_decoded))
    numbers = ~nan
    assert torch.equal(decoded[numbers].view(torch.uint8), eager_decoded[numbers].view(torch.uint8))


@given(case=wire_rows())
def test_wire_row_is_the_codes_and_scales_of_quantize(case):
    values, group_size, num_groups, dtype = case
    rows, decoded = encode_decode(EAGER_KERNELS, values, group_size, num_groups, dtype)
    q = qwz.quantize(values, group_size)
    row = WireRow(num_groups, group_size, 0, 4)
    assert torch.equal(row_scales(rows, row)[1].view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(row_codes(rows, row)[1].view(num_groups, group_size), q.codes)
    expected = qwz.dequantize(q, dtype)
    assert torch.equal(decoded[1].view(torch.uint8), expected.view(torch.uint8))


@given(x=tensors(4096, torch.float32))
def test_group_scales_are_the_scales_of_quantize(x):
    for group_size in (64, 1000):
        assert torch.equal(group_scales(x, group_size), qwz.quantize(x, group_size).scales)
    absmax = x.reshape(-1, 64).abs().amax(dim=1)
    assert torch.equal(scale_from_absmax(absmax), qwz.quantize(x, 64).scales)


# --------------------------------------------------------------------------- #
# Edge cases found by this suite (fixed; kept as regression tests)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("value", [2.0**-140, 1e-44])
def test_subnormal_scales_keep_the_bound(value):
    x = torch.zeros(64)
    x[0] = value
    assert_within_half_step(x, qwz.quantize(x))


def test_largest_finite_float_decodes_finite():
    x = torch.full((64,), torch.finfo(torch.float32).max)
    assert torch.isfinite(qwz.dequantize(qwz.quantize(x))).all()


def test_recompile_limit_falls_back_to_eager_logged_and_recorded(caplog):
    """Past dynamo's recompile limit a fused kernel runs the eager one (the same bytes), says
    so in the log and keeps the reason in `fallback`; inputs it has compiled for before stay
    fused without recompiling."""
    import torch._dynamo

    torch._dynamo.reset()
    kernel = FusedKernel(quant.encode_into)
    rows = {}
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level("WARNING", logger="qwz"):
        for num_groups in (1, 2, 1, 3):
            values = torch.linspace(-1.0, 1.0, 8 * num_groups)
            row = torch.zeros(num_groups * (8 + quant.SCALE_BYTES), dtype=torch.uint8)
            layout = WireRow(num_groups, 8, 0, 4)
            kernel(values, row_scales(row[None], layout)[0], row_codes(row[None], layout)[0])
            rows[num_groups] = row
            assert (kernel.fallback is None) == (num_groups != 3), num_groups
    torch._dynamo.reset()
    assert "recompile limit hit" in kernel.fallback
    assert any("recompile limit hit" in record.getMessage() for record in caplog.records)
    for num_groups, row in rows.items():
        expected = torch.zeros_like(row)
        layout = WireRow(num_groups, 8, 0, 4)
        quant.encode_into(
            torch.linspace(-1.0, 1.0, 8 * num_groups),
            row_scales(expected[None], layout)[0],
            row_codes(expected[None], layout)[0],
        )
        assert torch.equal(row, expected), num_groups
