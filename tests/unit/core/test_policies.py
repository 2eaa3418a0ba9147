"""The ZeroOptimizer's policies (qwz/policies.py) and the size helpers (qwz/sizes.py): a bad
field is refused where it is declared, naming the field, the value and the rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz.layout import plan_gather
from qwz.policies import GatherPolicy, OptimizerSpec, ReducePolicy
from qwz.sizes import ceil_div, round_up

GATHER = {"quantize": True, "group_size": 64, "preserve_numel": 0, "bucket_size": 1000}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("group_size", 0, "group_size: 0 is invalid: must be a positive integer"),
        ("group_size", True, "group_size: True is invalid"),
        ("preserve_numel", -1, "preserve_numel: -1 is invalid: must be an integer >= 0"),
        ("bucket_size", 0, "bucket_size: 0 is invalid: must be an integer >= 1"),
        ("shard_alignment", 96, "shard_alignment: 96 is invalid: must be a positive multiple"),
        ("shard_alignment", 0, "shard_alignment: 0 is invalid: must be a positive integer"),
    ],
)
def test_gather_policy_refuses_a_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        GatherPolicy(**{**GATHER, field: value})


def test_gather_policy_resolves_the_shard_alignment():
    assert GatherPolicy(**GATHER).resolved_shard_alignment == 64
    assert GatherPolicy(**GATHER, shard_alignment=8192).resolved_shard_alignment == 8192
    # The reference arm holds no groups: any positive alignment.
    unquantized = {**GATHER, "quantize": False, "shard_alignment": 96}
    assert GatherPolicy(**unquantized).resolved_shard_alignment == 96


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bucket_size": 0}, "bucket_size: 0 is invalid"),
        ({"bucket_size": 10, "dtype": torch.int8}, "dtype: torch.int8 is invalid"),
        ({"bucket_size": 10, "accumulate_dtype": None}, "accumulate_dtype: None is invalid"),
    ],
)
def test_reduce_policy_refuses_a_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ReducePolicy(**fields)


def test_optimizer_spec_refuses_an_unknown_type_and_freezes_its_params():
    with pytest.raises(ValueError, match=r"type: 'lamb' is invalid: must be one of"):
        OptimizerSpec("lamb")
    params = {"lr": 0.1}
    spec = OptimizerSpec("sgd", params)
    params["lr"] = 1.0
    assert spec.params["lr"] == 0.1
    with pytest.raises(TypeError):
        spec.params["lr"] = 2.0  # type: ignore[index]


def test_plan_gather_refuses_to_quantize_without_a_group_size():
    with pytest.raises(ValueError, match="group_size: None is invalid when quantizing"):
        plan_gather(
            world_size=2,
            source_numel=64,
            quantize=True,
            group_size=None,
            element_size=2,
            bucket_bytes=1 << 20,
        )


@given(numerator=st.integers(0, 10**6), denominator=st.integers(1, 10**4))
def test_ceil_div_and_round_up_match_their_definitions(numerator, denominator):
    quotient = ceil_div(numerator, denominator)
    assert (quotient - 1) * denominator < numerator <= quotient * denominator or numerator == 0
    padded = round_up(numerator, denominator)
    assert padded % denominator == 0 and 0 <= padded - numerator < denominator
