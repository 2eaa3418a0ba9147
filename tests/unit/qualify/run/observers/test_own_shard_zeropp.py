"""DeepSpeed's ZeRO++ scheme ([Note: DeepSpeed's ZeRO++ scheme], qwz/qualify/evidence/zeropp.py)
as the own-shard check applies it: every way the kernel may write a group passes and is
counted, the scheme is identified, and its broken variants fail naming what they are.

The decodes here are written independently of the judge's (zeropp.decodes): the kernel's steps
per group in plain torch, with each choice -- input, fast-math ulps of q and of the stored
scale, the decode's rounding -- made explicitly, and the broken variants as one changed step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwz.qualify.evidence import contract
from tests.unit.qualify.run.observers.test_own_shard_contract import judged, shards


def _moved(values: torch.Tensor, ulps: torch.Tensor) -> torch.Tensor:
    """`values` moved by `ulps` (per element, -2..2) fp32 ulps."""
    toward = torch.sign(ulps).float() * torch.inf
    for step in range(2):
        values = torch.where(ulps.abs() > step, torch.nextafter(values, toward), values)
    return values


def kernel(
    master: torch.Tensor,
    group_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    inputs: torch.Tensor | None = None,
    unrounded: torch.Tensor | None = None,
    q_ulps: torch.Tensor | None = None,
    s_ulps: torch.Tensor | None = None,
    clamp: bool = True,
    invert: bool = True,
) -> torch.Tensor:
    """A working copy of flat fp32 `master` written as DeepSpeed's kernel writes it, per group
    of `group_size`: the master or (``inputs[group]``) its cast to `dtype`, staged in fp16;
    q = 256/(2m) moved by ``q_ulps[group]``; codes half-to-even, clamped (or wrapping as int8);
    the stored scale 1/q moved by ``s_ulps[group]`` (or q itself, `invert` False); the decode
    through fp16, or (``unrounded[group]``) cast once to `dtype`."""
    numel = master.numel()
    groups = torch.nn.functional.pad(master.float(), (0, -numel % group_size))
    groups = groups.view(-1, group_size)
    count = groups.shape[0]
    no = torch.zeros(count, dtype=torch.bool)
    zero = torch.zeros(count, dtype=torch.long)
    inputs = no if inputs is None else inputs
    unrounded = no if unrounded is None else unrounded
    q_ulps = zero if q_ulps is None else q_ulps
    s_ulps = zero if s_ulps is None else s_ulps
    staged = torch.where(inputs[:, None], groups.to(dtype).float(), groups).half().float()
    m = staged.abs().amax(dim=1)
    q = torch.where(m == 0, torch.ones_like(m), _moved(torch.tensor(256.0) / (2 * m), q_ulps))
    product = staged * q[:, None]
    codes = torch.round(torch.nan_to_num(product, nan=0.0))
    codes = codes.clamp(-128, 127) if clamp else torch.where(codes > 127, codes - 256, codes)
    stored = _moved(torch.tensor(1.0) / q, s_ulps) if invert else q
    decoded = codes * stored[:, None]
    through_fp16 = decoded.half().float()
    written = torch.where(unrounded[:, None], decoded, through_fp16)
    return written.reshape(-1)[:numel].to(dtype)


@settings(deadline=None, max_examples=80)
@given(
    shards(magnitudes=(1e-6, 1e-3, 0.02, 1.0, 300.0)),
    st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_every_way_the_kernel_may_write_a_group_passes_as_zeropp(case, dtype):
    master, group_size, choice_seed = case
    count = -(-master.numel() // group_size)
    generator = torch.Generator().manual_seed(choice_seed)
    working = kernel(
        master,
        group_size,
        dtype=dtype,
        inputs=torch.randint(0, 2, (count,), generator=generator).bool(),
        unrounded=torch.randint(0, 2, (count,), generator=generator).bool(),
        q_ulps=torch.randint(-2, 3, (count,), generator=generator),
        s_ulps=torch.randint(-1, 2, (count,), generator=generator),
    )
    result = judged(master, working, group_size)
    assert result.mismatches == 0 and result.first_violation is None, result
    assert result.fp16_overflow == 0
    assert result.scheme in (contract.ZEROPP, None)
    assert result.by_scheme.get(contract.ABSMAX_127, 0) == 0


def test_the_reference_arithmetic_is_identified_and_counted_as_such():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02
    result = judged(master, kernel(master, 64), 64)
    assert result.mismatches == 0 and result.scheme == contract.ZEROPP
    assert result.reference + result.near_ties == 4096
    assert result.by_scheme == {contract.ZEROPP: 4096}
    assert result.unrounded_decode == result.working_input == result.scale_ulp == 0


def test_the_freedoms_are_counted_where_used():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 0.02
    count = 4096 // 64
    everywhere = torch.ones(count, dtype=torch.bool)
    unrounded = judged(master, kernel(master, 64, unrounded=everywhere), 64)
    assert unrounded.mismatches == 0 and unrounded.unrounded_decode > 0
    cast = judged(master, kernel(master, 64, inputs=everywhere), 64)
    assert cast.mismatches == 0 and cast.working_input > 0


def test_absmax_127_is_still_identified_as_itself():
    from tests.unit.qualify.run.observers.test_own_shard_contract import decode

    master = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 0.02
    result = judged(master, decode(master, 64), 64)
    assert result.mismatches == 0 and result.scheme == contract.ABSMAX_127
    assert result.by_scheme.get(contract.ZEROPP, 0) == 0


def test_a_shard_written_half_in_each_scheme_shows_both():
    from tests.unit.qualify.run.observers.test_own_shard_contract import decode

    master = torch.randn(1 << 17, generator=torch.Generator().manual_seed(4)) * 0.02
    half = master.numel() // 2
    working = torch.cat([decode(master[:half], 64), kernel(master[half:], 64)])
    result = judged(master, working, 64)
    assert result.mismatches == 0
    assert result.by_scheme[contract.ABSMAX_127] > 0 and result.by_scheme[contract.ZEROPP] > 0


def _broken(master, **broken):
    result = judged(master, kernel(master, 64, **broken), 64)
    assert result.mismatches > 0, result
    return result.first_violation["what"]


def test_without_the_clamp_code_128_wraps_and_the_judge_says_so():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 0.02
    what = _broken(master, clamp=False)
    assert "without its clamp" in what and "every one of the" in what, what
    assert "nearest scheme: DeepSpeed's ZeRO++ quantizer" in what, what


def test_the_stored_scale_not_inverted_fails_and_is_named():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(6)) * 0.02
    what = _broken(master, invert=False)
    assert "decoded with q instead of the stored scale" in what, what


def test_a_weight_beyond_fp16_range_is_an_overflow_not_a_mismatch():
    """bf16 holds 1e5; fp16 staging makes it infinite, and the kernel's whole group decodes to
    NaN: the scheme's own failure, counted as such."""
    master = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 0.02
    master[100] = 1.0e5
    working = kernel(master, 64)
    assert bool(torch.isnan(working[64:128]).all()) and not bool(torch.isnan(working[:64]).any())
    result = judged(master, working, 64)
    assert result.mismatches == 0 and result.fp16_overflow == 64, result
    assert result.scheme == contract.ZEROPP


@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_fast_math_division_moves_codes_and_decodes_and_passes(ulps):
    """q two ulps either way (``__fdividef``) moves a thousand of 262,144 elements of a
    realistic shard off the reference (a code past a near-tie, a decode past an fp16 rounding
    boundary); each is one the scheme's allowances accept."""
    master = torch.randn(64 * 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    working = kernel(master, 64, q_ulps=torch.full((4096,), ulps))
    assert int((working != kernel(master, 64)).sum()) > 500
    result = judged(master, working, 64)
    assert result.mismatches == 0 and result.near_ties > 500, result
