"""[Note: the contract and its freedoms] (qwz/qualify/evidence/spec.py) as the own-shard
check applies it (qwz/qualify/run/observers/own_shard.py): per group, any decode the contract allows
passes and is counted under the freedom it used; anything else fails.

The decodes here are written independently of the judge's own (spec.decode_choices): plain
torch per group, with the choice -- quantization input, scale arithmetic, tie rule, grid --
made explicitly.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwz.qualify.evidence import contract
from qwz.qualify.run.observers import own_shard
from qwz.shards import ShardSlot, make_own_shard

LARGE = 1 << 20
"""The parameter the shard belongs to is quantized (above the exactness threshold)."""


def _grouped(values: torch.Tensor, group_size: int, anchor: int = 0) -> torch.Tensor:
    """`values` (n,) as fp32 groups (U, G) of a grid starting `anchor` elements before
    ``values[0]`` (0: the partition's first element), zero-padded at both ends."""
    front = torch.zeros(anchor)
    back = torch.zeros(-(anchor + values.numel()) % group_size)
    return torch.cat([front, values.float(), back]).view(-1, group_size)


def _ungrouped(groups: torch.Tensor, numel: int, anchor: int = 0) -> torch.Tensor:
    return groups.reshape(-1)[anchor : anchor + numel]


def decode(
    master: torch.Tensor,
    group_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    inputs: torch.Tensor | None = None,
    scale_ulps: torch.Tensor | None = None,
    away_at_ties: bool = False,
    anchor: int = 0,
    divisor: float = 127.0,
    rounding=torch.round,
) -> torch.Tensor:
    """A candidate's working copy of flat fp32 `master`: per group, quantize the master or
    (where ``inputs[group]``) its cast to `dtype`, with scale ``absmax / divisor`` moved by
    ``scale_ulps[group]`` fp32 ulps, codes by `rounding` (half to even, or half away from
    zero), decoded and cast to `dtype`."""
    groups = _grouped(master, group_size, anchor)
    num_groups = groups.shape[0]
    if inputs is not None:
        groups = torch.where(inputs[:, None], groups.to(dtype).float(), groups)
    scales = groups.abs().amax(dim=1) / divisor
    if scale_ulps is not None:
        toward = torch.sign(scale_ulps).float() * torch.inf
        for moved in range(2):  # up to two ulps either way
            further = scale_ulps.abs() > moved
            scales = torch.where(further, torch.nextafter(scales, toward), scales)
    scales = torch.where(scales == 0, scales, scales.clamp(min=2.0**-126))
    quotient = groups / torch.where(scales == 0, torch.ones(num_groups), scales)[:, None]
    if away_at_ties:
        codes = torch.sign(quotient) * torch.floor(quotient.abs() + 0.5)
    else:
        codes = rounding(quotient)
    decoded = codes.clamp(-127, 127) * scales[:, None]
    return _ungrouped(decoded, master.numel(), anchor).to(dtype)


def judged(master: torch.Tensor, working: torch.Tensor, group_size: int):
    numel = master.numel()
    exact = torch.zeros(numel, dtype=torch.bool)
    shard = make_own_shard("s", master, working, group_size, exact, [ShardSlot("w", 0, numel, 0)])
    masks = own_shard.exact_masks([shard], group_size, {"w": LARGE}, gather_ranks=[2])
    result = own_shard.OwnShardResult()
    own_shard.check_own_shards([shard], masks, group_size, step=1, rank=0, result=result)
    return result


def assert_partition(result) -> None:
    """Every element is the reference, a mismatch, or used a freedom."""
    freedom = result.checked - result.reference - result.mismatches
    assert freedom >= 0
    assert (freedom == 0) == (result.working_input + result.scale_ulp + result.near_ties == 0)


@st.composite
def shards(draw, magnitudes=(1e-3, 0.02, 1.0, 300.0)):
    """A master shard (several groups, a partial last one) and the group size."""
    group_size = draw(st.sampled_from([8, 64]))
    num_groups = draw(st.integers(2, 12))
    numel = num_groups * group_size - draw(st.integers(0, group_size - 1))
    seed = draw(st.integers(0, 2**16))
    magnitude = draw(st.sampled_from(magnitudes))
    master = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * magnitude
    return master, group_size, draw(st.integers(0, 2**16))


@settings(deadline=None, max_examples=60)
@given(shards(), st.sampled_from([torch.bfloat16, torch.float32]))
def test_any_allowed_choice_per_group_passes_and_is_counted(case, dtype):
    master, group_size, choice_seed = case
    num_groups = -(-master.numel() // group_size)
    generator = torch.Generator().manual_seed(choice_seed)
    inputs = torch.randint(0, 2, (num_groups,), generator=generator).bool()
    scale_ulps = torch.randint(-1, 2, (num_groups,), generator=generator)
    away = bool(torch.randint(0, 2, (1,), generator=generator))
    working = decode(
        master, group_size, dtype=dtype, inputs=inputs, scale_ulps=scale_ulps, away_at_ties=away
    )
    result = judged(master, working, group_size)
    assert result.mismatches == 0 and result.first_violation is None, result
    assert result.checked == master.numel()
    assert_partition(result)


def test_the_reference_arithmetic_is_counted_as_such():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02
    result = judged(master, decode(master, 64), 64)
    assert result.reference == 4096 and result.mismatches == 0
    assert (result.working_input, result.scale_ulp, result.near_ties) == (0, 0, 0)


def test_the_working_cast_as_input_is_counted_as_that_freedom():
    master = torch.randn(8192, generator=torch.Generator().manual_seed(2)) * 0.02
    cast = torch.ones(8192 // 64, dtype=torch.bool)
    result = judged(master, decode(master, 64, inputs=cast), 64)
    assert result.mismatches == 0 and result.working_input > 1000, result
    assert result.scale_ulp == 0
    assert_partition(result)


def test_a_scale_one_ulp_off_is_counted_and_two_ulps_fail():
    """In fp32 a scale one ulp off shows in nearly every element (in bf16 rarely)."""
    master = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    groups = 4096 // 64
    for ulps in (1, -1):
        working = decode(master, 64, dtype=torch.float32, scale_ulps=torch.full((groups,), ulps))
        result = judged(master, working, 64)
        assert result.mismatches == 0 and result.scale_ulp > 3000, result
        assert_partition(result)
    for ulps in (2, -2):
        working = decode(master, 64, dtype=torch.float32, scale_ulps=torch.full((groups,), ulps))
        result = judged(master, working, 64)
        assert result.mismatches > 3000, result
        assert "no decode the contract allows" in result.first_violation["what"]
        assert result.scale_ulp == 0  # a group outside the contract used no freedom


def test_a_tie_may_go_either_way():
    """Exact ties (x / scale = k + 1/2): half to even and half away from zero both pass."""
    scale = 2.0**-7  # absmax 127 * 2**-7: every multiple of 2**-8 is a tie or a code
    master = torch.tensor([127.0, 2.5, -6.5, 0.5, 10.25, 4.5, 6.0, 0.0]) * scale
    for away in (False, True):
        result = judged(master, decode(master, 8, dtype=torch.float32, away_at_ties=away), 8)
        assert result.mismatches == 0, result
    assert result.near_ties == 4  # 2.5, -6.5, 0.5 and 4.5 went the other way


def test_one_code_off_away_from_a_tie_fails_alone():
    master = torch.randn(1024, generator=torch.Generator().manual_seed(4)) * 0.02
    working = decode(master, 64)
    groups = _grouped(master, 64)
    scales = groups.abs().amax(dim=1) / 127
    quotient = (groups / scales[:, None]).reshape(-1)[:1024]
    far_from_tie = ((quotient - quotient.floor() - 0.5).abs() > 0.1) & (quotient.abs() < 100)
    at = int(far_from_tie.nonzero()[7])
    with torch.no_grad():
        working[at] = ((quotient[at].round() + 1) * scales[at // 64]).to(torch.bfloat16)
    result = judged(master, working, 64)
    assert result.mismatches == 1 and result.first_violation["index"] == at, result
    assert result.reference == 1023


def test_groups_anchored_elsewhere_fail():
    """A grid starting half a group before the partition (at the parameter's start, say)."""
    master = torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 0.02
    result = judged(master, decode(master, 64, anchor=32), 64)
    assert result.mismatches > 1000, result


def test_a_group_mixing_two_inputs_is_not_a_choice():
    """Input and scale are one choice per group: half a group from the master, half from its
    cast, with each half's own scale, is outside the contract."""
    master = torch.randn(128, generator=torch.Generator().manual_seed(6)) * 0.02
    from_master = decode(master, 64)
    from_cast = decode(master, 64, inputs=torch.ones(2, dtype=torch.bool))
    assert not torch.equal(from_master[:64], from_cast[:64])
    differs = (from_master[:64] != from_cast[:64]).nonzero().reshape(-1)
    assert differs.numel() >= 2
    mixed = from_master.clone()
    half = differs[: differs.numel() // 2]  # these from the cast, the rest from the master
    mixed[half] = from_cast[half]
    result = judged(master, mixed, 64)
    assert 1 <= result.mismatches <= 64, result


def test_the_spec_mutants_decodes_fail():
    """The spec-level mutants' arithmetic, consistently applied: absmax/100, absmax/128 with
    codes clamped to 127, floor rounding."""
    master = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 0.02
    for wrong, named in (
        (decode(master, 64, divisor=100.0), "absmax/100"),
        (decode(master, 64, rounding=torch.floor), "floor"),
    ):
        result = judged(master, wrong, 64)
        assert result.mismatches > 1000, result
        assert named in result.first_violation["what"], result.first_violation


def test_absmax_over_128_clamped_to_127_fails_at_every_negative_absmax():
    """absmax/128 with codes clamped to [-127, 127] writes what DeepSpeed's ZeRO++ scheme
    writes (decoded once) except at a group's negative absmax, which ZeRO++'s code -128 keeps
    exact: every group whose absmax is negative fails there, and the judge names the near
    miss."""
    master = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 0.02
    groups = master.view(-1, 64)
    negative_absmax = int((groups.amin(dim=1).abs() > groups.amax(dim=1)).sum())
    assert negative_absmax > 20
    result = judged(master, decode(master, 64, divisor=128.0), 64)
    assert result.mismatches >= negative_absmax, result
    assert "absmax/128" in result.first_violation["what"], result.first_violation


def _tied(numel: int, group_size: int, seed: int) -> torch.Tensor:
    """A master whose every group has scale 2**-4 and every other element at ``x / scale`` a
    half-integer: the reference's nearest code and its neighbour both pass there."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-126, 126, (numel,), generator=generator).float() + 0.5
    codes = torch.where(torch.arange(numel) % 2 == 0, codes.round(), codes)
    codes[::group_size] = 127.0  # each group's absmax: scale 127 * 2**-4 / 127
    return codes * 2.0**-4


@settings(deadline=None, max_examples=60)
@given(shards(), st.sampled_from([torch.bfloat16, torch.float32]), st.booleans(), st.booleans())
def test_stopping_at_the_reference_gives_the_verdict_of_weighing_every_choice(
    case, dtype, tied, away
):
    """Where the reference arithmetic gives the whole piece the judge computes no other
    choice; every field of its verdict is the one weighing all of them gives (near-ties taken
    either way, exact elements among them)."""
    master, group_size, seed = case
    if tied:
        master = _tied(master.numel(), group_size, seed)
    exact = torch.rand(master.numel(), generator=torch.Generator().manual_seed(seed)) < 0.1
    # The exact elements are zeros in their groups and travel as the master's cast.
    quantized = torch.where(exact, torch.zeros_like(master), master)
    working = decode(quantized, group_size, dtype=dtype, away_at_ties=away)
    working = torch.where(exact, master.to(dtype), working)
    stopped = own_shard._judge_piece(master, working, group_size, exact, contract.ABSMAX_127)
    choices = list(contract.choices(contract.ABSMAX_127, master, exact, group_size, dtype))
    weighed = own_shard._judge_among_choices(master, working, exact, group_size, choices)
    assert not bool(stopped.mismatch.any())  # the reference gave it: the shortcut was taken
    for name, value in stopped._asdict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(weighed, name)), name
    assert stopped.scheme_only.keys() == weighed.scheme_only.keys() == {contract.ABSMAX_127}
    assert torch.equal(stopped.scheme_only[contract.ABSMAX_127], ~exact)
    if tied and away:  # where away-from-zero and half-to-even part, the neighbour is counted
        even = decode(quantized, group_size, dtype=dtype)
        parted = (working != even) & ~exact
        assert torch.equal(stopped.near_tie, parted), (stopped.near_tie, parted)
