"""Properties of ``QwzConfig.from_deepspeed``: DESIGN.md "Configuration rules".

Every rule has a property that fails when the rule is taken out of ``qwz/config.py``;
every rejection is checked to be a ``ConfigError`` whose message names the key and
the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import tempfile
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import qwz

from ..strategies import (
    BUCKET_KEYS,
    GROUP_SIZE_KEY,
    INVALID_BUCKET_SIZES,
    INVALID_GROUP_SIZES,
    OPTIMIZER_PARAM_KEYS,
    TOP_KEYS,
    UNSUPPORTED_OFF,
    UNSUPPORTED_ON,
    ZERO_KEYS,
    config_grammar,
    typos,
    valid_bucket_sizes,
    valid_configs,
    valid_group_sizes,
    valid_optimizers,
    with_feature,
)

STAGES = (0, 1, 2, 3)


def rejected(config: Any) -> str:
    """The message of the ConfigError `config` raises (fails the test if it does not)."""
    with pytest.raises(qwz.ConfigError) as caught:
        qwz.QwzConfig.from_deepspeed(config)
    return str(caught.value)


def zero_config(stage: int | None, **zero: Any) -> dict[str, Any]:
    section = dict(zero) if stage is None else {"stage": stage, **zero}
    return {"zero_optimization": section}


def osa_distance(a: str, b: str) -> int:
    """Edit distance counting an adjacent transposition as one edit."""
    rows = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[-1][-1]


def assert_suggests(message: str, typo: str, intended: str) -> None:
    """The message names the typo and suggests a known key at least as close as `intended`."""
    assert typo in message
    found = re.search(r"did you mean (\S+?)\?", message)
    assert found, message
    suggestion = found.group(1)
    assert suggestion == intended or osa_distance(typo, suggestion) <= osa_distance(
        typo, intended
    ), message


# --------------------------------------------------------------------------- #
# Group size
# --------------------------------------------------------------------------- #


def test_error_is_a_value_error():
    assert issubclass(qwz.ConfigError, ValueError)
    assert qwz.DEFAULT_GROUP_SIZE == 64


@given(group_size=valid_group_sizes())
def test_every_valid_group_size_is_accepted_at_stages_1_and_2(group_size):
    for stage in (1, 2):
        for enabled in (True, False):
            config = zero_config(
                stage, zero_quantized_weights=enabled, **{GROUP_SIZE_KEY: group_size}
            )
            cfg = qwz.QwzConfig.from_deepspeed(config)
            assert (cfg.stage, cfg.quantized_weights) == (stage, enabled)
            assert cfg.group_size == group_size
            assert type(cfg.group_size) is int


@given(group_size=valid_group_sizes(), stage=st.sampled_from([1, 2]))
def test_integral_float_group_size_is_read_as_int(group_size, stage):
    cfg = qwz.QwzConfig.from_deepspeed(zero_config(stage, **{GROUP_SIZE_KEY: float(group_size)}))
    assert cfg.group_size == group_size
    assert type(cfg.group_size) is int


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_group_size_defaults_to_64(stage):
    enabled = stage not in (None, 0)
    cfg = qwz.QwzConfig.from_deepspeed(zero_config(stage, zero_quantized_weights=enabled))
    assert cfg.group_size == qwz.DEFAULT_GROUP_SIZE == 64
    assert qwz.QwzConfig.from_deepspeed({}).group_size == 64


@pytest.mark.parametrize("kind", sorted(INVALID_GROUP_SIZES))
@given(data=st.data())
def test_every_invalid_group_size_is_rejected_at_every_stage(kind, data):
    value = data.draw(INVALID_GROUP_SIZES[kind], label="group_size")
    for stage in STAGES:
        # Quantization is off at stage 0 so the group size, not the stage-0 rule, fails.
        config = zero_config(stage, zero_quantized_weights=stage != 0, **{GROUP_SIZE_KEY: value})
        message = rejected(config)
        assert GROUP_SIZE_KEY in message
        assert repr(value) in message
        assert "multiple of 8" in message


@given(group_size=valid_group_sizes().map(lambda g: g if g != 64 else 128))
def test_stage_3_rejects_any_group_size_but_64(group_size):
    for value in (group_size, float(group_size)):
        message = rejected(zero_config(3, zero_quantized_weights=True, **{GROUP_SIZE_KEY: value}))
        assert GROUP_SIZE_KEY in message
        assert repr(value) in message
        assert "stage 3" in message


@pytest.mark.parametrize("value", [64, 64.0])
def test_stage_3_accepts_64(value):
    cfg = qwz.QwzConfig.from_deepspeed(
        zero_config(3, zero_quantized_weights=True, **{GROUP_SIZE_KEY: value})
    )
    assert (cfg.stage, cfg.group_size) == (3, 64)


# --------------------------------------------------------------------------- #
# Stage
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("stage", [None, 0, 0.0])
def test_quantized_weights_need_a_stage_above_0(stage):
    message = rejected(zero_config(stage, zero_quantized_weights=True))
    assert "zero_quantized_weights" in message
    assert "True" in message
    assert "stage" in message


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_weights_are_accepted_at_stages_1_to_3(stage):
    cfg = qwz.QwzConfig.from_deepspeed(zero_config(stage, zero_quantized_weights=True))
    assert cfg.quantized_weights is True
    assert cfg.stage == stage


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "1", None])
def test_invalid_stage_is_rejected(stage):
    message = rejected({"zero_optimization": {"stage": stage}})
    assert "zero_optimization.stage" in message
    assert repr(stage) in message


# --------------------------------------------------------------------------- #
# Bucket sizes
# --------------------------------------------------------------------------- #


@given(pair=valid_bucket_sizes(), stage=st.sampled_from(STAGES))
def test_bucket_sizes_accept_positive_integers_and_integral_floats(pair, stage):
    value, expected = pair
    for key in BUCKET_KEYS:
        cfg = qwz.QwzConfig.from_deepspeed(zero_config(stage, **{key: value}))
        assert getattr(cfg.zero, key) == expected
        assert type(getattr(cfg.zero, key)) is int


@pytest.mark.parametrize("key", BUCKET_KEYS)
def test_bucket_size_5e8_becomes_the_int_500000000(key):
    read = getattr(qwz.QwzConfig.from_deepspeed(zero_config(2, **{key: 5e8})).zero, key)
    assert read == 500_000_000
    assert type(read) is int


@pytest.mark.parametrize("kind", sorted(INVALID_BUCKET_SIZES))
@given(data=st.data())
def test_invalid_bucket_sizes_are_rejected_naming_the_key(kind, data):
    value = data.draw(INVALID_BUCKET_SIZES[kind], label="bucket_size")
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    for key in BUCKET_KEYS:
        message = rejected(zero_config(stage, **{key: value}))
        assert f"zero_optimization.{key}" in message
        assert repr(value) in message
        assert "positive integer" in message


# --------------------------------------------------------------------------- #
# Unknown keys and unsupported features
# --------------------------------------------------------------------------- #


def test_the_classic_group_size_typo_is_caught():
    message = rejected(zero_config(2, zero_quantized_weight_group_size=128))
    assert "zero_quantized_weight_group_size" in message
    assert f"did you mean {GROUP_SIZE_KEY}?" in message


@given(pair=typos(ZERO_KEYS), stage=st.sampled_from([1, 2]))
def test_unknown_zero_key_is_rejected_with_the_closest_key(pair, stage):
    intended, typo = pair
    assert_suggests(rejected(zero_config(stage, **{typo: 64})), typo, intended)


@given(pair=typos(TOP_KEYS), base=valid_configs())
def test_unknown_top_level_key_is_rejected_with_the_closest_key(pair, base):
    intended, typo = pair
    config, _ = base
    config[typo] = 1
    assert_suggests(rejected(config), typo, intended)


@given(kind=st.sampled_from(sorted(OPTIMIZER_PARAM_KEYS)), data=st.data())
def test_unknown_optimizer_param_is_rejected_with_the_closest_key(kind, data):
    intended, typo = data.draw(typos(OPTIMIZER_PARAM_KEYS[kind]))
    message = rejected({"optimizer": {"type": kind, "params": {"lr": 1e-3, typo: 0.1}}})
    assert_suggests(message, typo, intended)


@given(case=with_feature(UNSUPPORTED_ON))
def test_unsupported_deepspeed_features_are_rejected(case):
    config, key, value = case
    message = rejected(config)
    assert key in message
    assert repr(value) in message
    assert "not supported by qwz" in message


@given(case=with_feature(UNSUPPORTED_OFF))
def test_unsupported_features_switched_off_are_accepted(case):
    config, _, _ = case
    qwz.QwzConfig.from_deepspeed(config)


def test_offload_optimizer_device_none_is_accepted():
    config = zero_config(2, zero_quantized_weights=True, offload_optimizer={"device": "none"})
    assert qwz.QwzConfig.from_deepspeed(config).stage == 2


# --------------------------------------------------------------------------- #
# Other top-level settings
# --------------------------------------------------------------------------- #


def test_bf16_and_fp16_both_enabled_is_rejected():
    message = rejected({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert "bf16" in message
    assert "fp16" in message
    assert "at most one" in message


@pytest.mark.parametrize(
    ("sections", "dtype"),
    [
        ({}, "fp32"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": False}}, "bf16"),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": True}}, "fp16"),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "fp32"),
        ({"bf16": {}}, "fp32"),
    ],
)
def test_dtype_is_read_from_the_precision_sections(sections, dtype):
    assert qwz.QwzConfig.from_deepspeed(sections).dtype == dtype


@given(pair=valid_configs())
def test_valid_configs_are_read_field_by_field(pair):
    config, expected = pair
    cfg = qwz.QwzConfig.from_deepspeed(config)
    for name, value in expected.items():
        if name == "optimizer":
            continue
        read = getattr(cfg.zero, name[5:]) if name.startswith("zero.") else getattr(cfg, name)
        assert read == value, name
    if expected["optimizer"] is None:
        assert cfg.optimizer is None
    else:
        kind, params = expected["optimizer"]
        assert cfg.optimizer.type == kind
        assert dict(cfg.optimizer.params) == params


@given(triple=valid_optimizers())
def test_optimizer_type_and_params_are_read(triple):
    section, kind, params = triple
    cfg = qwz.QwzConfig.from_deepspeed({"optimizer": section})
    assert cfg.optimizer.type == kind in ("adamw", "adam", "sgd")
    assert dict(cfg.optimizer.params) == params


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gradient_accumulation_steps", 0),
        ("gradient_accumulation_steps", 2.5),
        ("gradient_accumulation_steps", True),
        ("gradient_clipping", -1.0),
        ("gradient_clipping", math.inf),
        ("gradient_clipping", "1.0"),
        ("train_micro_batch_size_per_gpu", 0),
        ("seed", 1.5),
        ("seed", "42"),
        ("optimizer", {"type": "Lamb", "params": {"lr": 1e-3}}),
        ("optimizer", {"type": "AdamW", "params": {"lr": -1e-3}}),
        ("optimizer", {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 1.0]}}),
        ("bf16", {"enabled": "yes"}),
        ("bf16", True),
    ],
)
def test_invalid_top_level_values_are_rejected_naming_the_key(key, value):
    message = rejected({key: value})
    assert key in message


# --------------------------------------------------------------------------- #
# Input forms
# --------------------------------------------------------------------------- #


@given(pair=valid_configs(), indent=st.sampled_from([None, 2]), lead=st.sampled_from(["", " \n"]))
def test_json_path_and_text_give_the_same_config_as_the_dict(pair, indent, lead):
    config, _ = pair
    text = lead + json.dumps(config, indent=indent)
    expected = qwz.QwzConfig.from_deepspeed(config)
    assert qwz.QwzConfig.from_deepspeed(text) == expected
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "ds_config.json"
        path.write_text(text)
        assert qwz.QwzConfig.from_deepspeed(path) == expected
        assert qwz.QwzConfig.from_deepspeed(str(path)) == expected


@given(pair=valid_configs(), cut=st.integers(1, 3))
def test_truncated_json_text_is_a_config_error(pair, cut):
    text = json.dumps(pair[0])
    # Dropping closing characters of an object never leaves valid JSON.
    message = rejected(text[:-cut] if len(text) > cut else "{")
    assert "not valid JSON" in message


@pytest.mark.parametrize(
    "text",
    [
        '{"seed": 1, "seed": 2}',
        '{"zero_optimization": {"stage": 1, "stage": 2}}',
        '{"optimizer": {"type": "SGD", "params": {"lr": 0.1, "lr": 0.2}}}',
    ],
)
def test_duplicate_json_keys_are_rejected(text):
    assert "duplicate key" in rejected(text)
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "dup.json"
        path.write_text(text)
        assert "duplicate key" in rejected(path)


@pytest.mark.parametrize("content", ["[1, 2]", "[]", "1", "null", '"text"', "{", ""])
def test_a_json_file_that_is_not_one_object_is_rejected(content):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "config.json"
        path.write_text(content)
        message = rejected(path)
        assert str(path) in message
        assert rejected(str(path)) == message


@pytest.mark.parametrize("text", ["[1, 2]", " [ ]", "[{}]"])
def test_json_array_text_is_rejected(text):
    rejected(text)


def test_missing_file_is_rejected():
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "absent.json"
        assert str(path) in rejected(path)
        assert str(path) in rejected(str(path))


@pytest.mark.parametrize("source", [42, None, b"{}", ["zero_optimization"]])
def test_other_source_types_are_rejected(source):
    rejected(source)


# --------------------------------------------------------------------------- #
# Immutability and the whole grammar
# --------------------------------------------------------------------------- #


def _dataclass_objects(cfg: qwz.QwzConfig) -> list[Any]:
    objects = [cfg, cfg.zero, cfg.zero.quantized_weights]
    return objects + ([cfg.optimizer] if cfg.optimizer is not None else [])


@given(pair=valid_configs())
def test_config_is_immutable(pair):
    cfg = qwz.QwzConfig.from_deepspeed(pair[0])
    before = repr(cfg)
    for obj in _dataclass_objects(cfg):
        for field in dataclasses.fields(obj):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, field.name, getattr(obj, field.name))
    if cfg.optimizer is not None:
        with pytest.raises(TypeError):
            cfg.optimizer.params["lr"] = 1.0  # type: ignore[index]
    assert repr(cfg) == before


@given(config=config_grammar())
def test_any_dict_is_either_a_config_or_a_config_error(config):
    """Only ConfigError ever escapes, and the JSON text of the dict behaves the same."""
    try:
        from_dict = qwz.QwzConfig.from_deepspeed(config)
    except qwz.ConfigError:
        from_dict = None
    try:
        from_text = qwz.QwzConfig.from_deepspeed(json.dumps(config))
    except qwz.ConfigError:
        from_text = None
    # NaN compares unequal to itself, so compare the renderings.
    assert repr(from_dict) == repr(from_text)


@given(pair=valid_configs())
def test_valid_configs_never_raise(pair):
    assert isinstance(qwz.QwzConfig.from_deepspeed(pair[0]), qwz.QwzConfig)


# --------------------------------------------------------------------------- #
# Edge cases found by this suite (fixed; kept as regression tests)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "config",
    [
        {"gradient_clipping": 10**400},
        {"optimizer": {"type": "SGD", "params": {"lr": 10**400}}},
    ],
)
def test_huge_json_integers_are_config_errors(config):
    rejected(config)


@pytest.mark.parametrize("kind", ["latin1_file", "nul_in_path"])
def test_unreadable_sources_are_config_errors(kind):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "config.json"
        path.write_bytes('{"seed": 1, "name": "café"}'.encode("latin-1"))
        rejected(path if kind == "latin1_file" else str(path) + "\x00")


def test_a_swapped_two_letter_key_gets_a_suggestion():
    message = rejected({"optimizer": {"type": "AdamW", "params": {"rl": 1e-3}}})
    assert_suggests(message, "rl", "lr")


@pytest.mark.parametrize("value", [1, 1.0, "true", False])
def test_default_only_keys_accept_exactly_deepspeeds_default(value):
    """`allgather_partitions` is accepted only as DeepSpeed's default, the bool true: a 1
    that merely compares equal is a different type and is refused, naming the key."""
    with pytest.raises(qwz.ConfigError, match="allgather_partitions"):
        qwz.QwzConfig.from_deepspeed({"zero_optimization": {"allgather_partitions": value}})
    config = qwz.QwzConfig.from_deepspeed({"zero_optimization": {"allgather_partitions": True}})
    assert config.stage == 0


def test_json_array_text_is_read_as_json_not_as_a_path():
    with pytest.raises(qwz.ConfigError, match="must hold a JSON object"):
        qwz.QwzConfig.from_deepspeed("[1, 2]")


@pytest.mark.parametrize("value", ["fp16", "bf16", "fp32", None])
def test_communication_and_grad_accum_dtypes_are_read(value):
    config = qwz.QwzConfig.from_deepspeed(
        {"communication_data_type": value, "data_types": {"grad_accum_dtype": value}}
    )
    assert config.communication_dtype == value and config.grad_accum_dtype == value


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"communication_data_type": "int8"}, "communication_data_type"),
        ({"data_types": {"grad_accum_dtype": "fp64"}}, "data_types.grad_accum_dtype"),
        ({"data_types": {"grad_acum_dtype": "fp32"}}, "grad_acum_dtype"),
        ({"data_types": "fp32"}, "data_types"),
    ],
)
def test_bad_communication_and_grad_accum_dtypes_name_the_key(config, key):
    with pytest.raises(qwz.ConfigError, match=key):
        qwz.QwzConfig.from_deepspeed(config)
