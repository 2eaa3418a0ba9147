"""fp16 loss scaling: the `fp16` config keys, the scaler against DeepSpeed's own, and the
engine's fp16 training at world size 1 against a plain torch reference.

See [Note: dynamic loss scale] (qwz/loss_scale.py). DeepSpeed refuses fp16 on CPUs without
AVX512-FP16, so these tests (and tests/multigpu/test_fp16.py) are where fp16 training is
covered on every machine."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import qwz
from qwz.config import ConfigError, LossScaleConfig, QwzConfig
from qwz.loss_scale import LossScaler
from tests.loss_scale_reference import deepspeed_scaler, step_masters

from .test_engine_single_rank import build_model, ds_config, loss_of, make_batches

# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def fp16_config(**section) -> QwzConfig:
    return QwzConfig.from_deepspeed({"fp16": {"enabled": True, **section}})


def test_fp16_section_defaults_are_deepspeeds():
    precision = pytest.importorskip(
        "deepspeed.runtime.precision_config", reason="the deepspeed extra is not installed"
    )
    ours = fp16_config().loss_scale
    theirs = precision.DeepSpeedFP16Config(enabled=True)
    assert ours.dynamic and theirs.loss_scale == 0
    assert ours.initial_scale_power == theirs.initial_scale_power == 16
    assert ours.window == theirs.loss_scale_window
    assert ours.hysteresis == theirs.hysteresis
    assert ours.consecutive_hysteresis == theirs.consecutive_hysteresis
    assert ours.min_scale == theirs.min_loss_scale


def test_fp16_section_is_read():
    config = fp16_config(
        loss_scale=128,
        initial_scale_power=8,
        loss_scale_window=50,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_loss_scale=4,
        auto_cast=True,
    )
    assert config.dtype == "fp16" and config.auto_cast
    assert config.loss_scale == LossScaleConfig(
        static_scale=128.0,
        initial_scale_power=8,
        window=50,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_scale=4,
    )
    assert not config.loss_scale.dynamic


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("loss_scale", -1, "must be a finite number >= 0"),
        ("loss_scale", "dynamic", "must be a number"),
        ("initial_scale_power", 128, "from 0 to 127"),
        ("initial_scale_power", -1, "from 0 to 127"),
        ("initial_scale_power", 2.5, "must be an integer"),
        ("loss_scale_window", 0, "must be a positive integer"),
        ("hysteresis", 0, "must be a positive integer"),
        ("min_loss_scale", 0, "must be a positive integer"),
        ("min_loss_scale", 0.5, "must be an integer"),
        ("consecutive_hysteresis", 1, "must be true or false"),
        ("auto_cast", "yes", "must be true or false"),
    ],
)
def test_bad_fp16_value_is_refused_naming_the_key(key, value, rule):
    with pytest.raises(ConfigError) as refused:
        fp16_config(**{key: value})
    assert f"fp16.{key}: " in str(refused.value) and rule in str(refused.value)


def test_fp16_typo_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError) as refused:
        fp16_config(loss_scale_windw=10)
    assert "loss_scale_window" in str(refused.value)


# --------------------------------------------------------------------------- #
# The scaler against DeepSpeed's
# --------------------------------------------------------------------------- #


@st.composite
def scale_configs(draw) -> LossScaleConfig:
    return LossScaleConfig(
        static_scale=draw(st.sampled_from([0.0, 0.0, 0.0, 1.0, 1024.0])),
        initial_scale_power=draw(st.integers(0, 12)),
        window=draw(st.integers(1, 5)),
        hysteresis=draw(st.integers(1, 4)),
        consecutive_hysteresis=draw(st.booleans()),
        min_scale=draw(st.sampled_from([1, 2, 4, 16])),
    )


@st.composite
def overflow_sequences(draw) -> list[bool]:
    """Runs of clean steps and of overflows: long clean runs are what make the scale grow
    and refill the hysteresis, and independent coin flips rarely produce them."""
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 8)), max_size=12))
    return [overflow for overflow, length in runs for _ in range(length)]


@given(config=scale_configs(), overflows=overflow_sequences())
@example(  # growth refills the hysteresis: the next overflow spends it, the one after halves
    config=LossScaleConfig(initial_scale_power=8, window=1, hysteresis=2),
    overflows=[True, False, False, True, True],
)
def test_scale_follows_deepspeeds_scaler_for_any_overflow_sequence(config, overflows):
    """Step by step the same scale as DeepSpeed's own scaler, and the same refusal when an
    overflow arrives at the minimum scale."""
    ours, theirs = LossScaler.from_config(config), deepspeed_scaler(config)
    for index, overflow in enumerate(overflows):
        assert ours.scale == theirs.cur_scale, index
        if overflow and ours.at_floor:
            with pytest.raises(Exception, match="minimum"):
                theirs.update_scale(overflow)
            with pytest.raises(FloatingPointError, match="min_loss_scale"):
                ours.update(overflow)
            return
        theirs.update_scale(overflow)
        ours.update(overflow)
    assert ours.scale == theirs.cur_scale


def test_state_dict_round_trips_and_refuses_other_keys():
    scaler = LossScaler.from_config(LossScaleConfig(window=2, hysteresis=1))
    for overflow in (True, False, False, False):
        scaler.update(overflow)
    restored = LossScaler.unscaled()
    restored.load_state_dict(scaler.state_dict())
    assert restored == scaler
    with pytest.raises(ValueError, match="keys"):
        restored.load_state_dict({"scale": 2.0})


# --------------------------------------------------------------------------- #
# fp16 training at world size 1 against plain torch
# --------------------------------------------------------------------------- #

FP16_SECTION = {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 2}
"""From 2**12 the scale doubles every two clean steps until the gradients overflow (at
2**15 on this model), spends its hysteresis, halves, and grows again."""
SPIKE_STEP = 11
"""A batch scaled by 1e6 overflows the fp16 forward on a step that would be clean."""


def fp16_batches(seed: int, steps: int, accumulation: int = 1):
    """`accumulation` micro-batches per step; the first of SPIKE_STEP's overflows."""
    batches = make_batches(seed, steps * accumulation)
    spike = (SPIKE_STEP - 1) * accumulation
    inputs, targets = batches[spike]
    batches[spike] = (inputs * 1e6, targets)
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


class Fp16Reference:
    """Plain torch: an fp16 model, fp32 master copies stepped by torch.optim.AdamW, fp32
    gradient accumulators, and DeepSpeed's loss scaler deciding the scale and which steps
    to skip. Clipping uses the engine's reported norm (see [Clipping reference] in
    test_engine_single_rank.py: the norm is a reduction in another order)."""

    def __init__(self, seed: int, config: dict):
        self.model = build_model(seed).half()
        self.masters = [
            p.detach().float().clone().requires_grad_(True) for p in self.model.parameters()
        ]
        self.adam = torch.optim.AdamW(self.masters, **config["optimizer"]["params"])
        self.scaler = deepspeed_scaler(QwzConfig.from_deepspeed(config).loss_scale)
        self.clipping = config["gradient_clipping"]

    def step(self, micro_batches, engine_norm: float) -> tuple[float, bool, float]:
        scale = self.scaler.cur_scale
        accumulated = [torch.zeros_like(master) for master in self.masters]
        for batch in micro_batches:
            self.model.zero_grad()
            ((loss_of(self.model, batch) / len(micro_batches)).float() * scale).backward()
            for total, param in zip(accumulated, self.model.parameters(), strict=True):
                total.add_(param.grad)
        grads = [total / scale for total in accumulated]
        norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item()
        overflow = not math.isfinite(norm)
        self.scaler.update_scale(overflow)
        if not overflow:
            if self.clipping:
                reported = torch.tensor(engine_norm, dtype=torch.float32)
                coefficient = torch.clamp(self.clipping / (reported + 1e-6), max=1.0)
                grads = [grad * coefficient for grad in grads]
            step_masters(self.adam, self.masters, self.model, grads)
        return scale, overflow, norm


@pytest.mark.parametrize(
    ("stage", "accumulation", "clipping"), [(1, 1, 0.0), (2, 1, 0.0), (1, 2, 0.5), (2, 2, 0.5)]
)
def test_fp16_training_matches_plain_torch_with_deepspeeds_loss_scaler(
    stage, accumulation, clipping
):
    seed, steps = 3, 16
    config = ds_config(
        stage=stage,
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        bucket=24,
        clipping=clipping,
        accumulation=accumulation,
    )
    config["fp16"] = {"enabled": True, **FP16_SECTION}
    engine = qwz.initialize(build_model(seed), config=config)
    reference = Fp16Reference(seed, config)
    assert next(engine.module.parameters()).dtype == torch.float16
    skipped, trace = 0, []
    for step, micro_batches in enumerate(fp16_batches(seed, steps, accumulation), start=1):
        scale_before = engine.loss_scale
        for micro, batch in enumerate(micro_batches, start=1):
            engine.backward(loss_of(engine, batch))
            stepped = engine.step()
            assert micro == accumulation or not stepped
        scale, overflow, norm = reference.step(micro_batches, engine.global_grad_norm)
        trace.append((scale, overflow, norm))
        assert scale_before == scale, step
        assert stepped == (not overflow), step
        skipped += overflow
        assert engine.skipped_steps == skipped and engine.global_steps == step
        if overflow:
            assert not math.isfinite(engine.global_grad_norm), step
        else:
            assert abs(engine.global_grad_norm - norm) <= 1e-6 * norm, step
            if clipping and step == 1:
                assert norm > clipping, "clipping must be active to be tested"
        for (name, actual), expected in zip(
            engine.module.named_parameters(), reference.model.parameters(), strict=True
        ):
            assert torch.equal(actual.detach(), expected.detach()), f"step {step}: {name}"
    # The run exercised what it claims: overflows from the scale and from the spike, and
    # the scale both growing and shrinking.
    overflows = [overflow for _, overflow, _ in trace]
    assert any(overflows[: SPIKE_STEP - 1]) and overflows[SPIKE_STEP - 1] and not all(overflows)
    pairs = list(itertools.pairwise(scale for scale, _, _ in trace))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)


def test_overflow_at_the_minimum_scale_raises_naming_the_parameters():
    config = ds_config(stage=2, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}, bucket=24)
    config["fp16"] = {"enabled": True, "initial_scale_power": 0, "hysteresis": 1}
    engine = qwz.initialize(build_model(0), config=config)
    inputs, targets = make_batches(0, 1)[0]
    engine.backward(loss_of(engine, (inputs * 1e6, targets)))
    with pytest.raises(qwz.NonFiniteError) as raised:
        engine.step()
    message = str(raised.value)
    assert "fp16.min_loss_scale" in message and "up.weight" in message
    assert "up.weight" in raised.value.parameters


def test_static_loss_scale_skips_overflows_and_never_moves():
    config = ds_config(stage=1, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}, bucket=24)
    config["fp16"] = {"enabled": True, "loss_scale": 8.0}
    engine = qwz.initialize(build_model(0), config=config)
    before = qwz.param_hash(engine.module)
    inputs, targets = make_batches(0, 1)[0]
    engine.backward(loss_of(engine, (inputs * 1e6, targets)))
    assert not engine.step()
    assert qwz.param_hash(engine.module) == before and engine.loss_scale == 8.0
    engine.backward(loss_of(engine, (inputs, targets)))
    assert engine.step()
    assert qwz.param_hash(engine.module) != before and engine.loss_scale == 8.0


def test_auto_cast_casts_floating_inputs_to_fp16():
    config = ds_config(stage=2, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}, bucket=24)
    config["fp16"] = {"enabled": True, "auto_cast": True}
    engine = qwz.initialize(build_model(0), config=config)
    inputs = make_batches(0, 1)[0][0]
    assert engine(inputs).dtype == torch.float16  # fp32 inputs, cast by the engine
    config["fp16"]["auto_cast"] = False
    plain = qwz.initialize(build_model(0), config=config)
    with pytest.raises(RuntimeError):
        plain(inputs)  # without auto_cast, fp32 inputs meet fp16 weights


def test_updated_weight_beyond_fp16_range_raises_naming_it_not_the_scale():
    """A master that the fp16 working copy cannot hold (|w| > 65504) is an error before
    the gather, named as such; the overflow-at-minimum note is not added to it."""
    config = ds_config(stage=2, optimizer={"type": "SGD", "params": {"lr": 1e9}}, bucket=24)
    config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine = qwz.initialize(build_model(0), config=config)
    before = qwz.param_hash(engine.module)
    engine.backward(loss_of(engine, make_batches(0, 1)[0]))
    with pytest.raises(qwz.NonFiniteError) as raised:
        engine.step()
    message = str(raised.value)
    assert "updated weight" in message and "65504" in message and "up.weight" in message
    assert "min_loss_scale" not in message
    assert raised.value.what == "updated weight"
    assert qwz.param_hash(engine.module) == before  # no working copy was changed


def test_fp16_accumulators_unscale_in_fp32():
    """With data_types.grad_accum_dtype fp16 the scaled gradients wait in fp16, but the
    division by the loss scale happens in fp32: tiny unscaled gradients do not flush to
    zero, and the norm equals the fp32-accumulator engine's."""
    norms = {}
    for accumulate in ("fp16", "fp32"):
        config = ds_config(stage=1, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, bucket=24)
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
        config["data_types"] = {"grad_accum_dtype": accumulate}
        engine = qwz.initialize(build_model(0), config=config)
        inputs, targets = make_batches(0, 1)[0]
        engine.backward(loss_of(engine, (inputs, targets)) * 1e-6)  # gradients ~1e-7
        assert engine.step()
        norms[accumulate] = engine.global_grad_norm
    assert norms["fp16"] == norms["fp32"] > 0


def test_fp16_values_are_read_only_when_fp16_is_enabled():
    """As in DeepSpeed: a disabled fp16 section's loss-scaling values are not validated."""
    config = QwzConfig.from_deepspeed({"fp16": {"enabled": False, "loss_scale_window": 0}})
    assert config.dtype == "fp32"


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"fp16_master_weights_and_grads": True}, "is not supported by qwz"),
        ({"loss_scale": 2.0**128}, "must be at most 2**127"),
    ],
)
def test_fp16_settings_qwz_cannot_honour_are_refused(section, expected):
    with pytest.raises(ConfigError, match=expected.replace("*", r"\*")):
        fp16_config(**section)
    fp16_config(fp16_master_weights_and_grads=False)  # DeepSpeed's default is accepted
