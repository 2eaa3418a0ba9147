"""Hypothesis strategies for the unit properties.

Every strategy constructs its value directly (valid or deliberately invalid); none
draws broadly and filters with ``assume``. Config strategies return plain
JSON-like dicts, often with the values the config is expected to read from them;
tensor strategies draw a seed and a few shape/magnitude parameters and build the
tensor with a seeded ``torch.Generator``, so hypothesis shrinks the parameters
rather than thousands of elements.
"""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
import torch

# --------------------------------------------------------------------------- #
# Config: keys
# --------------------------------------------------------------------------- #

GROUP_SIZE_KEY = "zero_quantized_weights_group_size"
BUCKET_KEYS = ("allgather_bucket_size", "reduce_bucket_size")

# The keys DESIGN.md says qwz reads; typos are made from these.
ZERO_KEYS = (
    "stage",
    "zero_quantized_weights",
    GROUP_SIZE_KEY,
    *BUCKET_KEYS,
    "overlap_comm",
    "contiguous_gradients",
)
TOP_KEYS = (
    "zero_optimization",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "seed",
)
OPTIMIZER_PARAM_KEYS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "weight_decay", "dampening", "nesterov"),
}

# Other DeepSpeed keys the grammar mixes in: some accepted (switched off, logging,
# stage-3 tuning, stock defaults), some unsupported. A typo is never built to equal one.
ZERO_OTHER_KEYS = (
    "offload_optimizer",
    "offload_param",
    "zenflow",
    "cpu_offload",
    "sub_group_size",
    "allgather_partitions",
    "reduce_scatter",
    "round_robin_gradients",
    "stage3_max_live_parameters",
    "stage3_prefetch_bucket_size",
    "zero_quantized_weights_preserve_numel",
)
TOP_OTHER_KEYS = (
    "steps_per_print",
    "wall_clock_breakdown",
    "scheduler",
    "amp",
    "activation_checkpointing",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sequence_parallel_size",
    "communication_data_type",
    "compile",
    "fp8",
)
ALL_KNOWN = frozenset(
    ZERO_KEYS
    + TOP_KEYS
    + ZERO_OTHER_KEYS
    + TOP_OTHER_KEYS
    + tuple(k for keys in OPTIMIZER_PARAM_KEYS.values() for k in keys)
    + ("type", "params", "enabled", "device", "stage3_gather_16bit_weights_on_model_save")
)


def single_edit_typos(key: str) -> list[str]:
    """Every string one deletion, adjacent swap or duplication away from `key`."""
    typos = set()
    for i in range(len(key)):
        typos.add(key[:i] + key[i + 1 :])  # deletion
        typos.add(key[: i + 1] + key[i] + key[i + 1 :])  # duplication
        if i + 1 < len(key) and key[i] != key[i + 1]:
            typos.add(key[:i] + key[i + 1] + key[i] + key[i + 2 :])  # swap
    typos.discard(key)
    return sorted(typos - ALL_KNOWN)


@st.composite
def typos(draw, keys: tuple[str, ...]) -> tuple[str, str]:
    """``(intended_key, typo)``: a known key with one character deleted, swapped or doubled.

    Two-letter keys (``lr``) are left out: their swap is a separate, known case.
    """
    key = draw(st.sampled_from([k for k in keys if len(k) > 2]))
    return key, draw(st.sampled_from(single_edit_typos(key)))


# --------------------------------------------------------------------------- #
# Config: values
# --------------------------------------------------------------------------- #

MAX_GROUP_MULTIPLE = 2**16  # group sizes up to 8 * 2**16 == 2**19


def valid_group_sizes(max_multiple: int = MAX_GROUP_MULTIPLE) -> st.SearchStrategy[int]:
    """Positive multiples of 8 up to ``8 * max_multiple``, with the notable ones up front
    (8, 64, 8192 and the largest)."""
    notable = [g for g in (8, 64, 8192, 8 * max_multiple) if g <= 8 * max_multiple]
    return st.one_of(
        st.sampled_from(notable),
        st.integers(1, max_multiple).map(lambda k: 8 * k),
    )


@st.composite
def non_multiples_of_8(draw, *, positive: bool = True) -> int:
    multiple = 8 * draw(st.integers(0 if positive else -(2**20), 2**20))
    return multiple + draw(st.integers(1, 7))


@st.composite
def non_integral_floats(draw) -> float:
    """Finite floats with a fractional part, or NaN/Inf (never integral by construction)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    whole = draw(st.integers(-(2**20), 2**20))
    # |whole| < 2**20 leaves 30+ bits of float64 mantissa for the fraction.
    return whole + draw(st.floats(0.001, 0.999))


def _strings() -> st.SearchStrategy[str]:
    """Strings, including ones that spell a valid number ("64", "5e8")."""
    return st.one_of(
        st.text(max_size=8),
        valid_group_sizes().map(str),
        st.sampled_from(["5e8", "64.0", "true", "none", ""]),
    )


# Each class of invalid `zero_quantized_weights_group_size`, built directly.
INVALID_GROUP_SIZES: dict[str, st.SearchStrategy[Any]] = {
    "non_positive": st.one_of(
        st.integers(max_value=0), st.integers(-(2**16), 0).map(lambda k: 8 * k)
    ),
    "not_multiple_of_8": non_multiples_of_8(positive=False),
    "non_positive_or_non_multiple_integral_float": st.one_of(
        st.integers(-(2**16), 0).map(lambda k: float(8 * k)),
        non_multiples_of_8().map(float),
    ),
    "bool": st.booleans(),
    "non_integral_float": non_integral_floats(),
    "string": _strings(),
    "none": st.none(),
    "list": st.lists(valid_group_sizes(), max_size=2),
    "dict": st.dictionaries(st.text(max_size=4), valid_group_sizes(), max_size=2),
}

# Each class of invalid bucket size.
INVALID_BUCKET_SIZES: dict[str, st.SearchStrategy[Any]] = {
    "non_positive": st.integers(max_value=0),
    "non_positive_integral_float": st.integers(-(2**40), 0).map(float),
    "non_integral_float": non_integral_floats(),
    "bool": st.booleans(),
    "string": _strings(),
    "none": st.none(),
    "list": st.lists(st.integers(1, 2**30), max_size=2),
}


@st.composite
def valid_bucket_sizes(draw) -> tuple[int | float, int]:
    """``(value, expected_int)``: a positive int, or the same number as an integral float."""
    number = draw(st.one_of(st.sampled_from([1, 500_000_000, 2**31]), st.integers(1, 2**52)))
    if draw(st.booleans()):
        return float(number), number
    return number, number


def _case_variants(word: str) -> st.SearchStrategy[str]:
    return st.sampled_from(sorted({word, word.lower(), word.upper(), word.capitalize()}))


@st.composite
def valid_optimizers(draw) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``(section, expected_type, expected_params)`` for AdamW, Adam or SGD."""
    spelled = draw(st.sampled_from(["AdamW", "Adam", "SGD"]))
    kind = spelled.lower()
    unit = st.floats(0.0, 0.999, allow_subnormal=False)
    params: dict[str, Any] = {}
    if draw(st.booleans()):  # DeepSpeed does not require lr: absent, it is the optimizer's default
        params["lr"] = draw(st.floats(0.0, 10.0, allow_subnormal=False))
    if draw(st.booleans()):
        params["weight_decay"] = draw(st.floats(0.0, 1.0, allow_subnormal=False))
    if kind in ("adamw", "adam"):
        if draw(st.booleans()):
            params["betas"] = [draw(unit), draw(unit)]
        if draw(st.booleans()):
            params["eps"] = draw(st.floats(1e-12, 1e-3))
    else:
        if draw(st.booleans()):
            params["momentum"] = draw(unit)
        if draw(st.booleans()):
            params["dampening"] = draw(unit)
        if draw(st.booleans()):
            params["nesterov"] = draw(st.booleans())
    expected = {k: tuple(v) if k == "betas" else v for k, v in params.items()}
    return {"type": draw(_case_variants(spelled)), "params": params}, kind, expected


@st.composite
def valid_configs(draw, *, stage: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, expected)``: a valid DeepSpeed-style dict and what QwzConfig must read.

    `expected` maps QwzConfig attribute names (and a few `zero.` ones) to values.
    """
    stage = draw(st.sampled_from([0, 1, 2, 3])) if stage is None else stage
    zero: dict[str, Any] = {}
    if stage != 0 or draw(st.booleans()):
        zero["stage"] = stage
    enabled = draw(st.booleans()) if stage != 0 else False
    if enabled or draw(st.booleans()):
        zero["zero_quantized_weights"] = enabled
    group_size = 64 if stage == 3 else draw(valid_group_sizes())
    if group_size != 64 or draw(st.booleans()):
        zero[GROUP_SIZE_KEY] = group_size
    buckets = {}
    for key in BUCKET_KEYS:
        buckets[key] = 500_000_000  # DeepSpeed's default
        if draw(st.booleans()):
            zero[key], buckets[key] = draw(valid_bucket_sizes())
    if draw(st.booleans()):
        zero["overlap_comm"] = False
    if draw(st.booleans()):
        zero["contiguous_gradients"] = True
    if draw(st.booleans()):
        zero["offload_optimizer"] = {"device": "none"}

    config: dict[str, Any] = {}
    if zero or draw(st.booleans()):
        config["zero_optimization"] = zero
    dtype = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    for name in ("bf16", "fp16"):
        if dtype == name:
            config[name] = {"enabled": True}
        elif draw(st.booleans()):
            config[name] = {"enabled": False}
    expected: dict[str, Any] = {
        "stage": stage,
        "quantized_weights": enabled,
        "group_size": group_size,
        "dtype": dtype,
        **{f"zero.{k}": v for k, v in buckets.items()},
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "micro_batch_size": None,
        "seed": None,
        "optimizer": None,
    }
    if draw(st.booleans()):
        expected["gradient_accumulation_steps"] = draw(st.integers(1, 1024))
        config["gradient_accumulation_steps"] = expected["gradient_accumulation_steps"]
    if draw(st.booleans()):
        expected["gradient_clipping"] = draw(st.floats(0.0, 1e6, allow_subnormal=False))
        config["gradient_clipping"] = expected["gradient_clipping"]
    if draw(st.booleans()):
        expected["micro_batch_size"] = draw(st.integers(1, 4096))
        config["train_micro_batch_size_per_gpu"] = expected["micro_batch_size"]
    if draw(st.booleans()):
        expected["seed"] = draw(st.integers(0, 2**63 - 1))
        config["seed"] = expected["seed"]
    if draw(st.booleans()):
        config["optimizer"], kind, params = draw(valid_optimizers())
        expected["optimizer"] = (kind, params)
    if draw(st.booleans()):
        config["steps_per_print"] = draw(st.integers(1, 1000))
    return config, expected


# Unsupported DeepSpeed features, switched on: (section or None for top level, key, value).
UNSUPPORTED_ON: tuple[tuple[str | None, str, st.SearchStrategy[Any]], ...] = (
    (
        "zero_optimization",
        "offload_optimizer",
        st.fixed_dictionaries(
            {"device": st.sampled_from(["cpu", "nvme", "CPU"])},
            optional={"pin_memory": st.booleans()},
        ),
    ),
    ("zero_optimization", "offload_param", st.just({"device": "cpu", "pin_memory": True})),
    ("zero_optimization", "zenflow", st.just({"topk_ratio": 0.05, "update_interval": 4})),
    ("zero_optimization", "cpu_offload", st.just(True)),
    ("zero_optimization", "sub_group_size", st.integers(1, 10**9)),
    ("zero_optimization", "overlap_comm", st.just(True)),
    ("zero_optimization", "reduce_scatter", st.just(False)),
    (
        None,
        "scheduler",
        st.just({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}),
    ),
    (None, "amp", st.just({"enabled": True})),
    (None, "activation_checkpointing", st.just({"partition_activations": True})),
    (None, "prescale_gradients", st.just(True)),
    (None, "gradient_predivide_factor", st.floats(1.5, 8.0)),
    (None, "sequence_parallel_size", st.integers(2, 8)),
    (None, "compile", st.just({"enabled": True})),
)

# The same features present but switched off: accepted.
UNSUPPORTED_OFF: tuple[tuple[str | None, str, st.SearchStrategy[Any]], ...] = (
    (
        "zero_optimization",
        "offload_optimizer",
        st.sampled_from([{"device": "none"}, {"device": "none", "pin_memory": True}, None]),
    ),
    ("zero_optimization", "offload_param", st.sampled_from([{"device": "none"}, None])),
    ("zero_optimization", "zenflow", st.sampled_from([None, False, {"enabled": False}])),
    (None, "scheduler", st.sampled_from([None, {"enabled": False}])),
    (None, "prescale_gradients", st.just(False)),
    (None, "gradient_predivide_factor", st.just(1.0)),
    (None, "sequence_parallel_size", st.just(1)),
    (None, "communication_data_type", st.none()),
)


@st.composite
def with_feature(
    draw, features: tuple[tuple[str | None, str, st.SearchStrategy[Any]], ...]
) -> tuple[dict[str, Any], str, Any]:
    """``(config, key, value)``: a valid stage-1/2 config with one feature section added."""
    config, _ = draw(valid_configs(stage=draw(st.sampled_from([1, 2]))))
    section, key, values = draw(st.sampled_from(features))
    value = draw(values)
    if section is None:
        config[key] = value
    else:
        config.setdefault(section, {})[key] = value
    return config, key, value


# --------------------------------------------------------------------------- #
# Config: a grammar of valid and invalid keys and values
# --------------------------------------------------------------------------- #

# Ints stay within the float range: ints too large for a float are a separate, known case.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.sampled_from([0, 1, 3, 8, 64, 100, 5e8, 64.0, -1, 0.5, 1.0]),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["none", "cpu", "AdamW", "sgd", "64"]),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _keys(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(known),
        typos(known).map(lambda pair: pair[1]),
        st.text(max_size=8),
    )


def _value_for(key: str) -> st.SearchStrategy[Any]:
    if key == GROUP_SIZE_KEY:
        return st.one_of(valid_group_sizes(), *INVALID_GROUP_SIZES.values())
    if key in BUCKET_KEYS:
        return st.one_of(valid_bucket_sizes().map(lambda pair: pair[0]), _JSON)
    if key in ("offload_optimizer", "offload_param"):
        return st.one_of(
            st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu", None])}), _JSON
        )
    if key in ("bf16", "fp16"):
        return st.one_of(
            st.fixed_dictionaries({"enabled": st.one_of(st.booleans(), _SCALARS)}), _JSON
        )
    if key == "optimizer":
        return st.one_of(valid_optimizers().map(lambda triple: triple[0]), _optimizer_grammar())
    if key == "zero_optimization":
        return st.one_of(_zero_grammar(), _JSON)
    return _JSON


def _section(keys: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw) -> dict[str, Any]:
        section = {}
        for key in draw(st.lists(keys, max_size=6, unique=True)):
            section[key] = draw(_value_for(key))
        return section

    return build()


def _zero_grammar() -> st.SearchStrategy[dict[str, Any]]:
    return _section(_keys(ZERO_KEYS + ZERO_OTHER_KEYS))


def _optimizer_grammar() -> st.SearchStrategy[dict[str, Any]]:
    param_keys = tuple(sorted({k for keys in OPTIMIZER_PARAM_KEYS.values() for k in keys}))
    return st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(st.sampled_from(["AdamW", "adam", "SGD", "lamb"]), _SCALARS),
            "params": st.one_of(
                st.dictionaries(_keys(param_keys), _JSON, max_size=4),
                _JSON,
            ),
        },
    )


def config_grammar() -> st.SearchStrategy[dict[str, Any]]:
    """Random top-level dicts mixing known keys, typos, arbitrary keys and nested sections."""
    return st.one_of(
        _section(_keys(TOP_KEYS + TOP_OTHER_KEYS)),
        valid_configs().map(lambda pair: pair[0]),
    )


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Base-2 exponents of the magnitudes drawn per dtype: 2**-20 .. 2**30 for fp32 and
# bf16; fp16 stays within its range (max 65504, so exponents up to 15).
EXPONENT_RANGE = {
    torch.float32: (-20, 30),
    torch.bfloat16: (-20, 30),
    torch.float16: (-20, 15),
}

# Elements per drawn tensor stay below about this, so one example costs a millisecond.
NUMEL_BUDGET = 1 << 12


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@st.composite
def shapes_with_numel(draw, numel: int) -> tuple[int, ...]:
    """A shape of 0 to 4 dimensions whose product is `numel`."""
    if numel == 0:
        return draw(st.sampled_from([(0,), (3, 0), (0, 5, 2)]))
    ndim = draw(st.integers(0 if numel == 1 else 1, 4))
    if ndim == 0:
        return ()
    dims, rest = [], numel
    for _ in range(ndim - 1):
        dim = draw(st.sampled_from(_divisors(rest)))
        dims.append(dim)
        rest //= dim
    dims.append(rest)
    return tuple(draw(st.permutations(dims)))


@st.composite
def tensors(
    draw,
    numel: int,
    dtype: torch.dtype,
    exponents: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A `dtype` tensor of `numel` elements, any shape, possibly non-contiguous.

    Magnitudes are ``m * 2**e`` with ``m`` in [1, 2) and ``e`` drawn per element from
    a window inside `exponents`, so one group can span the whole dynamic range; some
    elements are exact zeros (of either sign) and a few sit exactly on the extremes.
    """
    low, high = exponents or EXPONENT_RANGE[dtype]
    window_low = draw(st.integers(low, high))
    window_high = draw(st.integers(window_low, high))
    zero_fraction = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    exps = torch.randint(window_low, window_high + 1, (numel,), generator=generator)
    mantissas = 1.0 + torch.rand(numel, generator=generator, dtype=torch.float64)
    signs = torch.randint(0, 2, (numel,), generator=generator).to(torch.float64) * 2 - 1
    values = signs * mantissas * torch.exp2(exps.to(torch.float64))
    zeros = torch.rand(numel, generator=generator) < zero_fraction
    values[zeros] = signs[zeros] * 0.0
    if numel:
        for index, exponent, sign in draw(
            st.lists(
                st.tuples(
                    st.integers(0, numel - 1),
                    st.sampled_from([low, high]),
                    st.sampled_from([-1, 1]),
                ),
                max_size=3,
            )
        ):
            values[index] = sign * 2.0**exponent
    values = values.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    shape = draw(shapes_with_numel(numel))
    if len(shape) >= 2 and draw(st.booleans()):
        # Same values, built transposed: a non-contiguous view.
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return values.reshape(swapped).transpose(-1, -2)
    return values.reshape(shape)


@st.composite
def tensor_and_group_size(
    draw,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    ragged: bool | None = None,
    max_multiple: int = 2**10,
    exponents: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, int]:
    """``(x, group_size)``; `ragged` True makes numel not a multiple of the group size,
    False a non-zero multiple, None either (numel 0 included)."""
    dtype = draw(st.sampled_from(dtypes))
    group_size = draw(valid_group_sizes(max_multiple))
    full_groups = draw(st.integers(1 if ragged is False else 0, max(1, NUMEL_BUDGET // group_size)))
    if ragged is False:
        remainder = 0
    else:
        remainder = draw(st.integers(1 if ragged else 0, min(group_size - 1, NUMEL_BUDGET)))
    numel = full_groups * group_size + remainder
    return draw(tensors(numel, dtype, exponents)), group_size


@st.composite
def poisoned(draw) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
    """``(clean, x, group_size, bad_groups)``: `x` is `clean` with NaN/Inf put into some groups."""
    clean, group_size = draw(tensor_and_group_size(ragged=draw(st.booleans())))
    flat = clean.reshape(-1).clone()
    numel = flat.numel()  # >= 1: ragged or at least one full group
    num_groups = -(-numel // group_size)
    bad_groups = draw(
        st.lists(
            st.integers(0, num_groups - 1), min_size=1, max_size=min(3, num_groups), unique=True
        )
    )
    for group in bad_groups:
        last = min(numel, (group + 1) * group_size) - 1
        for index in draw(st.lists(st.integers(group * group_size, last), min_size=1, max_size=3)):
            flat[index] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return clean, flat.reshape(clean.shape), group_size, sorted(bad_groups)
