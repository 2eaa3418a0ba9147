"""What the harness observes on a rank, at world size 1: ``qwz/qualify/run/observers/``.

[Note: layout-independent digests] and [Note: exact update check] are tested on
plain tensors and a plain torch AdamW, so each property is checked without a
process group and without an engine.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz.qualify.evidence.optimizer import AdamWSettings
from qwz.qualify.run.observers import digest, own_shard, piecewise, update
from qwz.shards import ShardSlot, make_own_shard, slots_in_range

SETTINGS = AdamWSettings(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def shards_of(values: dict[str, torch.Tensor], cuts: list[int]):
    """The flat concatenation of `values`, cut into shards at `cuts` (as different ranks or
    group sizes would shard it), each an OwnShard with its parameter slots."""
    flat = torch.cat([value.reshape(-1) for value in values.values()])
    ranges, offset = [], 0
    for name, value in values.items():
        ranges.append((name, offset, value.numel()))
        offset += value.numel()
    bounds = [0, *cuts, flat.numel()]
    return [
        make_own_shard(f"s{i}", flat[a:b], flat[a:b], None, None, slots_in_range(ranges, a, b))
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


@st.composite
def parameters_and_cuts(draw):
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    values = {f"p{i}": torch.randn(size, generator=generator) for i, size in enumerate(sizes)}
    total = sum(sizes)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, total - 1)), max_size=3)))
    cuts = [cut for cut in cuts if 0 < cut < total]
    other = sorted(draw(st.sets(st.integers(1, max(1, total - 1)), max_size=3)))
    other = [cut for cut in other if 0 < cut < total]
    return values, cuts, other


@given(parameters_and_cuts())
def test_master_digests_do_not_depend_on_the_sharding(case):
    values, cuts, other = case
    names = list(values)
    assert digest.master_digests(shards_of(values, cuts), names) == (
        digest.master_digests(shards_of(values, other), names)
    )


@given(parameters_and_cuts(), st.data())
def test_one_changed_element_always_changes_its_parameters_digest(case, data):
    values, cuts, _ = case
    names = list(values)
    name = data.draw(st.sampled_from(names))
    index = data.draw(st.integers(0, values[name].numel() - 1))
    changed = {key: value.clone() for key, value in values.items()}
    bits = changed[name].view(torch.int32)
    bits[index] ^= 1 << data.draw(st.integers(0, 31))  # any single bit of the float
    before = digest.master_digests(shards_of(values, cuts), names)
    after = digest.master_digests(shards_of(changed, cuts), names)
    assert before[name] != after[name]
    assert all(before[other] == after[other] for other in names if other != name)


def _optimizer_and_shard(numel: int = 256, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    master = torch.nn.Parameter(torch.randn(numel, generator=generator))
    optimizer = torch.optim.AdamW(
        [master], lr=SETTINGS.lr, betas=SETTINGS.betas, eps=SETTINGS.eps,
        weight_decay=SETTINGS.weight_decay,
    )  # fmt: skip
    working = master.detach().clone()
    shard = make_own_shard("s", master, working, None, None, (ShardSlot("w", 0, numel, 0),))
    return master, optimizer, shard, generator


def _train(master, optimizer, check, generator, steps: int, between=None) -> None:
    for step in range(1, steps + 1):
        master.grad = torch.randn(master.numel(), generator=generator)
        check.begin_step(step)
        optimizer.step()
        check.end_step()
        if between is not None:
            between(step)


def _check(optimizer, shard, settings=SETTINGS):
    return update.UpdateCheck([shard], optimizer, settings, samples_per_shard=64, seed=0, rank=0)


def test_torch_adamw_passes_the_update_check_well_inside_the_bound():
    master, optimizer, shard, generator = _optimizer_and_shard()
    check = _check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=12)
    assert check.result.violations == 0 and check.result.missing_steps == []
    assert check.result.checked == 12 * 64
    assert 0 < check.result.max_ratio < 1


def test_a_different_learning_rate_is_caught_at_the_first_step():
    master, optimizer, shard, generator = _optimizer_and_shard()
    check = _check(optimizer, shard, AdamWSettings(1.01e-3, (0.9, 0.999), 1e-8, 0.1))
    _train(master, optimizer, check, generator, steps=3)
    assert check.result.violations > 0
    assert check.result.first_violation["step"] == 1


def test_a_dropped_weight_decay_is_caught():
    master, optimizer, shard, generator = _optimizer_and_shard()
    optimizer.param_groups[0]["weight_decay"] = 0.0
    check = _check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=2)
    assert check.result.first_violation is not None
    assert check.result.first_violation["parameter"] == "w"


def test_a_master_written_outside_the_step_breaks_continuity():
    master, optimizer, shard, generator = _optimizer_and_shard()
    check = _check(optimizer, shard)

    def nudge(step):
        if step == 3:
            with torch.no_grad():
                master.mul_(1 + 2**-20)

    _train(master, optimizer, check, generator, steps=5, between=nudge)
    violation = check.result.first_violation
    assert violation["step"] == 4 and "outside the optimizer step" in violation["what"]


def test_a_skipped_optimizer_step_is_a_missing_step():
    _, optimizer, shard, _ = _optimizer_and_shard()
    check = _check(optimizer, shard)
    check.begin_step(1)
    check.end_step()  # no optimizer.step() in between
    assert check.result.missing_steps == [1]
    assert check.result.first_violation["what"] == "the optimizer stepped 0 times"


def test_the_update_bound_scales_with_a_huge_weight_decay_product():
    """lr * wd >> 1 (a diverging run): the decayed weight's own rounding is allowed for."""
    settings = AdamWSettings(lr=1e6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    master, _, shard, generator = _optimizer_and_shard()
    optimizer = torch.optim.AdamW([master], lr=1e6, weight_decay=0.1)
    check = _check(optimizer, shard, settings)
    _train(master, optimizer, check, generator, steps=1)
    assert check.result.violations == 0, check.result.first_violation
    assert math.isfinite(check.result.max_ratio)


class Float32HyperparameterAdamW(torch.optim.Optimizer):
    """AdamW as a fused op computes it ([Note: float32 hyperparameters]), written here
    independently: every hyperparameter a float32 value, ``1 - beta`` formed from it, the
    bias corrections from a float32 running product of the betas, the decay and the update
    applied as two additions (DeepSpeed's CPU Adam's order)."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, eps, wd = (f32(group[key]) for key in ("lr", "eps", "weight_decay"))
            beta1, beta2 = (f32(beta) for beta in group["betas"])
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state.update(step=0, powers=(f32(1.0), f32(1.0)))
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                state["powers"] = (state["powers"][0] * beta1, state["powers"][1] * beta2)
                correction1 = 1 - state["powers"][0]
                correction2 = 1 / torch.sqrt(1 - state["powers"][1])
                grad = param.grad
                state["exp_avg"].mul_(beta1).add_(grad * (1 - beta1))
                state["exp_avg_sq"].mul_(beta2).add_(grad * grad * (1 - beta2))
                denom = state["exp_avg_sq"].sqrt() * correction2 + eps
                param.add_(param * (-lr * wd))
                param.add_(state["exp_avg"] / denom * (-lr / correction1))


def f32(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _fused_like(settings=SETTINGS, seed=0):
    master, _, shard, generator = _optimizer_and_shard(seed=seed)
    optimizer = Float32HyperparameterAdamW(
        [master], settings.lr, settings.betas, settings.eps, settings.weight_decay
    )
    return master, optimizer, shard, generator


def test_a_fused_adam_with_float32_hyperparameters_passes(monkeypatch):
    """Correct AdamW of the float32 values of the hyperparameters: within the float32
    reading's bound, though the exact reading alone fails it (1 - beta2 is 108 float32 ulps
    off)."""
    master, optimizer, shard, generator = _fused_like()
    check = _check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=12)
    assert check.result.violations == 0, check.result.first_violation
    assert check.result.checked == 12 * 64 and check.result.max_ratio < 1

    monkeypatch.setattr(update, "READINGS", (False,))  # the exact reading alone
    master, optimizer, shard, generator = _fused_like()
    check = _check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=2)
    assert check.result.violations > 0 and check.result.first_violation["step"] == 1


@pytest.mark.parametrize(
    ("broken", "settings"),
    [
        ("a learning rate 0.1% off", AdamWSettings(1.001e-3, (0.9, 0.999), 1e-8, 0.1)),
        ("a dropped weight decay", AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.0)),
        ("beta2 0.99 for 0.999", AdamWSettings(1e-3, (0.9, 0.99), 1e-8, 0.1)),
    ],
)
def test_the_float32_reading_still_catches_a_wrong_hyperparameter(broken, settings):
    """The fused-like optimizer runs with `settings`; the check expects the configured
    SETTINGS: each difference is outside both readings' bounds."""
    master, optimizer, shard, generator = _fused_like(settings)
    check = _check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=3)
    assert check.result.violations > 0, broken


def test_an_optimizer_not_re_derived_is_counted_and_its_norm_checked_only():
    master, _, shard, generator = _optimizer_and_shard()
    optimizer = torch.optim.SGD([master], lr=0.1)
    check = update.UpdateCheck([shard], optimizer, None, samples_per_shard=64, seed=0, rank=0)
    _train(master, optimizer, check, generator, steps=3)
    assert check.result.checked == 0 and check.result.violations == 0
    assert check.result.missing_steps == []
    check.begin_step(4)
    check.end_step()  # no optimizer.step(): still a missing step
    assert check.result.missing_steps == [4]


# --------------------------------------------------------------------------- #
# The digest's arithmetic: int32 pieces equal the int64 definition
# --------------------------------------------------------------------------- #


def digest_by_definition(values: torch.Tensor, first_index: int) -> int:
    """[Note: layout-independent digests] written out in int64, element by element."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64) & digest.MASK32
    indices = torch.arange(first_index, first_index + values.numel(), dtype=torch.int64)
    terms = (bits ^ ((indices * digest.K1) & digest.MASK32)) * digest.K2
    return int((terms & digest.MASK32).sum())


def random_bits(numel: int, seed: int) -> torch.Tensor:
    """fp32 values with random bit patterns: NaNs of any payload, infinities, subnormals."""
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-(2**31), 2**31, (numel,), generator=generator, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


CHUNK = piecewise.CPU_PIECE_NUMEL


@given(
    numel=st.sampled_from([0, 1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]),
    first_index=st.sampled_from([0, 1, 12_345, 2**31 - 1, 2**31 + 5, 2**40 + 7]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_digest_equals_its_int64_definition(numel, first_index, dtype, seed):
    """Across piece boundaries, at any offset, for fp32 and bf16 values, NaN bits included
    (the int32 sum needs its 2**32-per-negative-term correction to get there)."""
    values = random_bits(numel, seed).to(dtype)
    assert int(digest._digest_sum(values, first_index)) == digest_by_definition(values, first_index)


def test_replica_digests_are_the_definition_per_parameter():
    module = torch.nn.Sequential(torch.nn.Linear(300, 250), torch.nn.Linear(250, 3))
    module.to(torch.bfloat16)
    names, digests = digest.replica_digests(module)
    assert names == [name for name, _ in module.named_parameters()]
    for (_, param), value in zip(module.named_parameters(), digests.tolist(), strict=True):
        assert value == digest_by_definition(param.detach().reshape(-1), 0)


# --------------------------------------------------------------- [Note: global norm check]


def _clipped_training(numel=256, steps=4, clip=1.0, coefficient_factor=1.0, norm_factor=1.0):
    """AdamW on one shard with the engine's clipping done here: the reported norm is the true
    one times `norm_factor` and clips too; the coefficient applied is off by
    `coefficient_factor`. Returns the update check after `steps` steps."""
    master, optimizer, shard, generator = _optimizer_and_shard(numel)
    check = _check(optimizer, shard)
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=generator) * 0.5
        reported = float(grad.double().norm()) * norm_factor
        coefficient = min(1.0, clip / (reported + 1e-6)) if clip > 0 else 1.0
        master.grad = grad * (coefficient * coefficient_factor)
        check.begin_step(step)
        optimizer.step()
        check.end_step()
        check.check_norm(reported, clip)
    return check.result


@pytest.mark.parametrize("clip", [1.0, 0.0, 1e6])  # clipping on, off, never reached
def test_a_correctly_clipped_gradient_passes_the_norm_check(clip):
    result = _clipped_training(clip=clip)
    assert result.norm_checked == 4 and result.norm_violations == 0
    assert result.norm_max_ratio < 0.1


@pytest.mark.parametrize(
    "changes",
    [
        {"coefficient_factor": 0.8},  # a wrong clip coefficient
        {"norm_factor": 2.2121 / 2.9729},  # a wrong norm, reported and clipped with
        {"norm_factor": 2.2121 / 2.9729, "clip": 0.0},  # a wrong norm, no clipping
        {"clip": 100.0, "norm_factor": 1e-3},  # no clip where one was due
    ],
)
def test_a_wrong_norm_or_coefficient_is_caught_at_the_first_step(changes):
    result = _clipped_training(**changes)
    assert result.norm_violations == 4
    assert result.first_violation["step"] == 1
    assert result.first_violation["parameter"] == "(global gradient norm)"


# --------------------------------------------------------------- [Note: own shard against the spec]


def _quantized_shard(working_of, numel=1000, group_size=64, small=None, seed=0):
    """One shard of a parameter "w" (and a small one, "b", of `small` elements, exact) whose
    working copy is `working_of(master_with_b_zeroed, group_size)` (b: its exact cast)."""
    generator = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=generator) * 0.02
    slots = [ShardSlot("w", 0, numel if small is None else numel - small, 0)]
    exact = torch.zeros(numel, dtype=torch.bool)
    if small is not None:
        slots.append(ShardSlot("b", numel - small, numel, 0))
        exact[numel - small :] = True
    quantized = torch.where(exact, torch.zeros_like(master), master)
    working = torch.where(exact, master, working_of(quantized, group_size)).to(torch.bfloat16)
    shard = make_own_shard("s", master, working, group_size, exact, slots)
    numel_of = {"w": 1 << 20, "b": small or 0}  # the shard holds part of a large "w"
    masks = own_shard.exact_masks([shard], group_size, numel_of, gather_ranks=[2])
    return shard, masks


def _judged(shard, masks, group_size=64):
    result = own_shard.OwnShardResult()
    own_shard.check_own_shards([shard], masks, group_size, step=3, rank=1, result=result)
    return result


def _qwz_eager_decode(values, group_size):
    from qwz import quant

    return quant.dequantize(quant.quantize(values, group_size))


def test_qwz_kernels_decode_is_the_spec_decode_up_to_near_ties():
    shard, masks = _quantized_shard(_qwz_eager_decode, numel=70_000, small=None)
    result = _judged(shard, masks)
    assert result.checked == 70_000 and result.mismatches == 0, result.first_violation
    assert result.first_violation is None and result.max_ratio <= 1


def _over_100(values, group_size):
    groups = torch.nn.functional.pad(values, (0, -values.numel() % group_size))
    groups = groups.view(-1, group_size)
    scales = groups.abs().amax(dim=1, keepdim=True) / 100
    codes = torch.round(groups / scales).clamp(-127, 127)
    return (codes * scales).reshape(-1)[: values.numel()]


def _floor(values, group_size):
    from qwz.qualify.evidence import spec

    element_scales = spec.scales(values, group_size).repeat_interleave(group_size)
    element_scales = element_scales[: values.numel()]
    return torch.floor(values / element_scales).clamp(-127, 127) * element_scales


@pytest.mark.parametrize("wrong", [_over_100, _floor], ids=["absmax/100", "floor"])
def test_a_decode_that_is_not_the_specs_fails_although_within_its_bound(wrong):
    shard, masks = _quantized_shard(wrong)
    result = _judged(shard, masks)
    assert result.mismatches > 100
    violation = result.first_violation
    assert (violation["step"], violation["rank"], violation["parameter"]) == (3, 1, "w")
    assert "the spec decodes to" in violation["what"] and not violation["exact_required"]


def test_a_small_parameter_that_was_quantized_fails_as_exact_required():
    shard, masks = _quantized_shard(_qwz_eager_decode, small=100)
    with torch.no_grad():  # b decoded from its own group instead of sent exactly
        shard.working[-100:] = _qwz_eager_decode(shard.master[-100:], 64).to(torch.bfloat16)
    result = _judged(shard, masks)
    assert result.first_violation["parameter"] == "b" and result.first_violation["exact_required"]
    assert result.max_ratio == math.inf


def _one_rank_shard(working_of, numel=1000, seed=0):
    """A shard of a large parameter "w" whose working copy is `working_of(master)`."""
    master = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.02
    working = working_of(master).to(torch.bfloat16)
    exact = torch.zeros(numel, dtype=torch.bool)
    return make_own_shard("s", master, working, 64, exact, [ShardSlot("w", 0, numel, 0)])


def test_a_one_rank_gather_group_is_judged_exact_with_a_group_size_requested():
    """At one rank the gather copies (no int8 on the wire, the engine reports no group size):
    the spec says exact, so the exact cast passes there although 64 was requested, and the
    same shard judged as if two ranks gathered it fails (the bug one-rank runs had)."""
    shard = _one_rank_shard(lambda master: master)
    one_rank = own_shard.exact_masks([shard], 64, {"w": 1 << 20}, gather_ranks=[1])
    result = _judged(shard, one_rank)
    assert result.checked == 1000 and result.mismatches == 0, result.first_violation
    two_ranks = own_shard.exact_masks([shard], 64, {"w": 1 << 20}, gather_ranks=[2])
    assert _judged(shard, two_ranks).mismatches > 100


def test_a_one_rank_shard_that_was_quantized_fails_as_exact_required():
    shard = _one_rank_shard(lambda master: _qwz_eager_decode(master, 64))
    masks = own_shard.exact_masks([shard], 64, {"w": 1 << 20}, gather_ranks=[1])
    result = _judged(shard, masks)
    assert result.mismatches > 100 and result.first_violation["exact_required"]


def test_exact_masks_need_one_gather_group_per_shard():
    shard = _one_rank_shard(lambda master: master)
    with pytest.raises(ValueError, match="gather_ranks: 2 entries for 1 own shards"):
        own_shard.exact_masks([shard], 64, {"w": 1 << 20}, gather_ranks=[1, 1])


def test_bounded_pieces_give_the_same_verdict_and_find_a_late_mismatch(monkeypatch):
    shard, masks = _quantized_shard(_qwz_eager_decode, numel=5_000)
    with torch.no_grad():
        shard.working[4_321] = -shard.working[4_321] + 1
    whole = _judged(shard, masks)
    monkeypatch.setattr(piecewise, "CPU_PIECE_NUMEL", 100)  # pieces of one 64-group
    assert piecewise.piece_numel(torch.device("cpu"), 64) == 64
    pieces = _judged(shard, masks)
    assert (pieces.mismatches, pieces.near_ties, pieces.max_ratio) == (
        whole.mismatches,
        whole.near_ties,
        whole.max_ratio,
    )
    assert pieces.mismatches == 1 and pieces.first_violation["index"] == 4_321
    assert pieces.first_violation == whole.first_violation


def test_checks_run_in_bounded_pieces_of_whole_groups_on_every_device():
    for device in ("cpu", "cuda", "meta"):
        for group_size in (1, 64, 8192, 1 << 23):
            piece = piecewise.piece_numel(torch.device(device), group_size)
            assert piece % group_size == 0 and piece >= group_size
            assert piece <= max(group_size, piecewise.DEVICE_PIECE_NUMEL)
    assert piecewise.piece_numel(torch.device("cpu")) == piecewise.CPU_PIECE_NUMEL
