"""Hostile config input: ``QwzConfig.from_deepspeed`` raises only ConfigError, with a bounded
one-line message, never blocks and never reads without bound (issue 9, "Config parser")."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import qwz
from qwz.config import ConfigError, QwzConfig
from qwz.config_keys import TOP_KNOWN, ZERO_KNOWN

MESSAGE_LIMIT = 2000  # the longest fixed part: the list of known zero_optimization keys


def rejected(source, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as error:
        QwzConfig.from_deepspeed(source)
    message = str(error.value)
    assert len(message) < MESSAGE_LIMIT and "\n" not in message, message[:1000]
    return message


def deep(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting_in_a_dict_is_a_bounded_config_error():
    rejected({"scheduler": deep(100_000)}, "scheduler: .* is not supported by qwz")
    rejected({"zero_optimization": {"stage": deep(100_000)}}, "zero_optimization.stage")


def test_deep_nesting_in_json_text_is_refused_before_parsing():
    rejected('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested 100001 levels deep")


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"zero_optimization": {"stage": 10**5000}}, "zero_optimization.stage"),
        ({"gradient_clipping": 10**5000}, "gradient_clipping"),
        ({"train_batch_size": -(10**5000)}, "train_batch_size"),
        ({"zero_optimization": {"zero_quantized_weights_group_size": 10**5000 + 1}}, "group_size"),
        ({"optimizer": {"type": 10**5000}}, "optimizer.type"),
        ({"scheduler": {"n": 10**5000}}, "scheduler"),
        ({"zero_optimization": {"offload_param": {"device": 10**5000}}}, "config"),
    ],
)
def test_huge_integers_give_bounded_messages(config, key):
    message = rejected(config, key)
    assert "digits>" in message or "could not be validated" in message


def test_a_huge_integer_in_json_text_is_refused():
    rejected('{"seed": ' + "9" * 5000 + "}", "5,000 digits is out of the 64-bit range")


@pytest.mark.parametrize(
    "config",
    [
        {"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "betas": [0.9] * 1_000_000}}},
        {"zero_optimization": {"stage": ["x" * 100_000] * 100}},
        {"x" * 1_000_000: 1},
        {"zero_optimization": {"y" * 1_000_000: 1}},
    ],
    ids=["long-list", "long-strings", "long-top-key", "long-zero-key"],
)
def test_long_values_give_bounded_messages(config):
    rejected(config, "is invalid|unknown key|not supported")


def test_an_empty_string_says_so():
    for text in ("", "   ", "\n"):
        message = rejected(text, "an empty string is neither JSON text nor a path")
        assert "'.'" not in message


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def read():
        try:
            QwzConfig.from_deepspeed(str(fifo))
        except BaseException as error:
            errors.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "from_deepspeed blocked on a FIFO"
    assert isinstance(errors[0], ConfigError) and "a FIFO" in str(errors[0])


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom"])
def test_devices_are_refused(path):
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    rejected(path, "not a regular file \\(a character device\\)")


def test_a_directory_a_missing_file_and_a_nul_byte(tmp_path):
    rejected(tmp_path, "a directory")
    rejected(str(tmp_path / "absent.json"), "No such file")
    rejected("ds\0config.json", "not a usable path")


def test_a_file_config_still_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert QwzConfig.from_deepspeed(path).stage == 2
    assert QwzConfig.from_deepspeed(str(path)).stage == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"seed": NaN}', "NaN"),
        ('{"gradient_clipping": 1e400}', "out of the float range"),
        ('{"seed": 1, "seed": 2}', "duplicate key 'seed'"),
        ('{"zero_optimization": {"stage": 1, "stage": 2}}', "duplicate key 'stage'"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"a": ', "not valid JSON"),
    ],
)
def test_json_text_problems(text, match):
    rejected(text, match)


# --------------------------------------------------------------------------- #
# Fuzz: nothing but a QwzConfig or a bounded ConfigError
# --------------------------------------------------------------------------- #

HOSTILE_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**300 + 10).map(lambda n: n * 10**4000)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["none", "cpu", "adamw", "AdamW", "sgd", "nvme", "auto"])
    | st.just(deep(200))
    | st.just([0.5] * 50_000)
)

CONFIG_VALUES = st.recursive(
    HOSTILE_LEAVES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["enabled", "device", "type", "params", "lr", "betas", "eps"])
            | st.text(max_size=5),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@st.composite
def hostile_configs(draw) -> dict:
    config = draw(
        st.dictionaries(st.sampled_from(TOP_KNOWN) | st.text(max_size=6), CONFIG_VALUES, max_size=4)
    )
    if draw(st.booleans()):
        config["zero_optimization"] = draw(
            st.dictionaries(st.sampled_from(ZERO_KNOWN), CONFIG_VALUES, max_size=4)
        )
    return config


def _validate_or_refuse(source) -> None:
    try:
        QwzConfig.from_deepspeed(source)
    except ConfigError as error:
        assert len(str(error)) < MESSAGE_LIMIT and "\n" not in str(error), str(error)[:1000]


@given(hostile_configs())
def test_hostile_dicts_validate_or_raise_config_error(config):
    _validate_or_refuse(config)


@given(st.text(max_size=200))
def test_arbitrary_text_validates_or_raises_config_error(text):
    if text.strip() and not text.lstrip().startswith(("{", "[")):
        text = "{" + text  # a path-like string would touch the file system
    _validate_or_refuse(text)


@given(hostile_configs())
def test_hostile_json_text_validates_or_raises_config_error(config):
    try:
        text = json.dumps(config)
    except (ValueError, RecursionError):
        return  # not representable as JSON text (an integer of 4,000 digits)
    _validate_or_refuse(text)


def test_config_error_is_what_qwz_exports():
    assert qwz.ConfigError is ConfigError and issubclass(ConfigError, ValueError)
