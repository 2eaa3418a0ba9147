"""QwzConfig: a DeepSpeed-style JSON config in, validated and immutable settings out.

qwz reads the config dict DeepSpeed users already have. Every rule of
DESIGN.md's "Configuration rules" is enforced here and nowhere else; the layers
below (engine, optimizer, collectives, quant) never read a config. The key tables are in
:mod:`qwz.config_keys`.

Every failure is a :class:`ConfigError` whose message names the key (as a dotted
path), the offending value and the rule it broke. Nothing is silently ignored:
an unknown key is an error that suggests the closest known key, and a DeepSpeed
feature that qwz does not implement is an error that says so.
"""

from __future__ import annotations

import difflib
import math
import numbers
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qwz.config_keys import (
    BF16_KNOWN,
    FP16_KNOWN,
    GROUP_SIZE_KEY,
    OPTIMIZER_PARAMS,
    PRESERVE_KEY,
    QUANTIZED_WEIGHTS_KEY,
    TOP_KNOWN,
    TOP_UNSUPPORTED,
    ZERO_DEFAULT_ONLY,
    ZERO_KNOWN,
    ZERO_UNSUPPORTED,
)
from qwz.jsonio import JsonInputError, bounded_repr, parse_json_text, read_json_file
from qwz.policies import OPTIMIZER_TYPES
from qwz.quant import DEFAULT_GROUP_SIZE

GROUP_SIZE_MULTIPLE = 8
"""Group sizes must be multiples of this (vector width of the int8 codes)."""

DEFAULT_PRESERVE_NUMEL = 65_536
"""Parameters of at most this many elements travel exactly, never quantized ([Note: small
parameters travel exactly], layout.py)."""

DEFAULT_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default for ``allgather_bucket_size`` and ``reduce_bucket_size``."""


class ConfigError(ValueError):
    """A config value broke a rule; the message names the key, the value and the rule."""


def _fail(key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{key}: {bounded_repr(value)} is invalid: {rule}")


def _closest_key(key: str, known: tuple[str, ...]) -> str | None:
    if len(key) > 100:  # no known key is that long, and difflib is quadratic
        return None
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    # difflib scores short transpositions low ('rl' vs 'lr' is 0.5): same letters, same length.
    anagrams = [name for name in known if len(name) == len(key) and sorted(name) == sorted(key)]
    return anagrams[0] if anagrams else None


def _unknown_key(path: str, key: Any, known: tuple[str, ...]) -> ConfigError:
    close = _closest_key(str(key), known) if isinstance(key, str) else None
    hint = f"; did you mean {close}?" if close else f"; known keys: {', '.join(sorted(known))}"
    printable = isinstance(key, str) and key.isprintable() and 0 < len(key) <= 100
    name = key if printable else bounded_repr(key, 100)
    return ConfigError(f"{path}{name}: unknown key (a typo is never ignored){hint}")


def _not_supported(key: str, value: Any, detail: str = "") -> ConfigError:
    extra = f" ({detail})" if detail else ""
    return ConfigError(f"{key}: {bounded_repr(value)} is not supported by qwz{extra}")


def _check_keys(section: Mapping[str, Any], path: str, known: tuple[str, ...]) -> None:
    for key in section:
        if key not in known:
            raise _unknown_key(path, key, known)


# --------------------------------------------------------------------------- #
# Scalar rules
# --------------------------------------------------------------------------- #


def _as_int(key: str, value: Any, rule: str) -> int:
    """An integer; integral floats (``5e8``) are accepted as DeepSpeed accepts them."""
    if isinstance(value, bool):
        raise _fail(key, value, f"{rule} (a bool is not an integer)")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _fail(key, value, f"{rule} (must be an integer)")


def _positive_int(key: str, value: Any) -> int:
    number = _as_int(key, value, "must be a positive integer")
    if number <= 0:
        raise _fail(key, value, "must be a positive integer")
    return number


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "must be true or false")
    return value


def _float(key: str, value: Any, *, minimum: float, inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(key, value, "must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf  # an integer beyond the float range: rejected below as not finite
    ok = number >= minimum if inclusive else number > minimum
    if not math.isfinite(number) or not ok:
        bound = ">=" if inclusive else ">"
        raise _fail(key, value, f"must be a finite number {bound} {minimum}")
    return number


def validate_group_size(value: Any, *, stage: int, key: str = GROUP_SIZE_KEY) -> int:
    """The quantization group size rule: a positive multiple of 8; 64 only with stage 3."""
    size = _as_int(key, value, f"must be a positive multiple of {GROUP_SIZE_MULTIPLE}")
    if size <= 0 or size % GROUP_SIZE_MULTIPLE:
        raise _fail(key, value, f"must be a positive multiple of {GROUP_SIZE_MULTIPLE}")
    if stage == 3 and size != DEFAULT_GROUP_SIZE:
        raise _fail(
            key,
            value,
            f"stage 3 supports only the default group size {DEFAULT_GROUP_SIZE}",
        )
    return size


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class QuantizedWeights:
    """The qwz-owned keys of `zero_optimization`, shared by the engine and the DeepSpeed path."""

    enabled: bool = False
    """`zero_quantized_weights`: gather updated weights as int8 codes + fp32 scales."""
    group_size: int = DEFAULT_GROUP_SIZE
    """`zero_quantized_weights_group_size`: elements per quantization group."""
    preserve_numel: int = DEFAULT_PRESERVE_NUMEL
    """`zero_quantized_weights_preserve_numel`: parameters this small travel exactly."""

    @classmethod
    def from_section(cls, section: Mapping[str, Any], stage: int) -> QuantizedWeights:
        prefix = "zero_optimization."
        enabled = _bool(prefix + QUANTIZED_WEIGHTS_KEY, section.get(QUANTIZED_WEIGHTS_KEY, False))
        if enabled and stage == 0:
            raise _fail(
                prefix + QUANTIZED_WEIGHTS_KEY,
                enabled,
                "needs ZeRO stage 1, 2 or 3 (stage 0 has no weight all-gather to quantize)",
            )
        group_size = validate_group_size(
            section.get(GROUP_SIZE_KEY, DEFAULT_GROUP_SIZE),
            stage=stage,
            key=prefix + GROUP_SIZE_KEY,
        )
        preserve_numel = _as_int(
            prefix + PRESERVE_KEY,
            section.get(PRESERVE_KEY, DEFAULT_PRESERVE_NUMEL),
            "must be a non-negative integer",
        )
        if preserve_numel < 0:
            raise _fail(prefix + PRESERVE_KEY, preserve_numel, "must be a non-negative integer")
        return cls(enabled=enabled, group_size=group_size, preserve_numel=preserve_numel)


def parse_stage(section: Mapping[str, Any]) -> int:
    stage = _as_int("zero_optimization.stage", section.get("stage", 0), "must be 0, 1, 2 or 3")
    if stage not in (0, 1, 2, 3):
        raise _fail("zero_optimization.stage", stage, "must be 0, 1, 2 or 3")
    return stage


@dataclass(frozen=True)
class ZeroConfig:
    """The `zero_optimization` section."""

    stage: int = 0
    """ZeRO stage: 1 shards optimizer state, 2 also shards gradients."""
    quantized_weights: QuantizedWeights = field(default_factory=QuantizedWeights)
    """The quantized weight all-gather settings."""
    allgather_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Caps the gather staging, in elements of the working dtype (see the staging note)."""
    reduce_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements of gradient reduced per collective."""
    overlap_comm: bool = False
    """Overlap reduction with backward; qwz's engine reduces after backward, so only false."""
    contiguous_gradients: bool = True
    """Gradients are flattened into one contiguous buffer; qwz always does this."""

    @classmethod
    def from_section(cls, section: Any) -> ZeroConfig:
        if not isinstance(section, Mapping):
            raise _fail("zero_optimization", section, "must be a JSON object")
        _check_keys(section, "zero_optimization.", ZERO_KNOWN)
        for key, default in ZERO_DEFAULT_ONLY.items():
            if key in section and (section[key] is not default):
                raise _not_supported(
                    f"zero_optimization.{key}", section[key], f"only {default!r} is implemented"
                )
        for key in ZERO_UNSUPPORTED:
            if key in section and not _switched_off(key, section[key]):
                raise _not_supported(f"zero_optimization.{key}", section[key])
        stage = parse_stage(section)
        overlap = _bool("zero_optimization.overlap_comm", section.get("overlap_comm", False))
        if overlap:
            raise _not_supported(
                "zero_optimization.overlap_comm",
                overlap,
                "qwz's engine reduces gradients after backward; set false, or use "
                "qwz.integrations.deepspeed for DeepSpeed's overlapped reduction",
            )
        contiguous = _bool(
            "zero_optimization.contiguous_gradients", section.get("contiguous_gradients", True)
        )
        if not contiguous:
            raise _not_supported(
                "zero_optimization.contiguous_gradients",
                contiguous,
                "qwz always reduces from one contiguous gradient buffer",
            )
        return cls(
            stage=stage,
            quantized_weights=QuantizedWeights.from_section(section, stage),
            allgather_bucket_size=_positive_int(
                "zero_optimization.allgather_bucket_size",
                section.get("allgather_bucket_size", DEFAULT_BUCKET_SIZE),
            ),
            reduce_bucket_size=_positive_int(
                "zero_optimization.reduce_bucket_size",
                section.get("reduce_bucket_size", DEFAULT_BUCKET_SIZE),
            ),
            overlap_comm=overlap,
            contiguous_gradients=contiguous,
        )


def offload_enabled(value: Any) -> bool:
    """Whether a DeepSpeed `offload_optimizer` / `offload_param` section offloads anything:
    only with a device other than "none", DeepSpeed's default."""
    if value is None or value is False:
        return False
    if isinstance(value, Mapping):
        if value.get("enabled") is False:
            return False
        device = value.get("device", "none")
        return device is not None and str(device).lower() != "none"
    return True


def _switched_off(key: str, value: Any) -> bool:
    """A feature present but off: `false`, `null`, `enabled: false`; offload to device none."""
    if key.startswith("offload_"):
        return not offload_enabled(value)
    if value is None or value is False:
        return True
    return isinstance(value, Mapping) and value.get("enabled") is False


@dataclass(frozen=True)
class OptimizerConfig:
    """The `optimizer` section: `{"type": "AdamW", "params": {...}}`."""

    type: str = "adamw"
    """Lower-cased type: `adamw`, `adam` (decoupled weight decay unless `adam_w_mode` is false,
    as in DeepSpeed) or `sgd`."""
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Validated keyword arguments, only those given: a missing one (`lr` included) takes the
    default of the optimizer DeepSpeed would build ([Note: DeepSpeed's optimizer defaults],
    qwz/optimizer.py)."""

    @classmethod
    def from_section(cls, section: Any) -> OptimizerConfig:
        if not isinstance(section, Mapping):
            raise _fail("optimizer", section, "must be a JSON object with type and params")
        _check_keys(section, "optimizer.", ("type", "params"))
        kind = section.get("type")
        if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_TYPES:
            raise _not_supported("optimizer.type", kind, f"supported: {', '.join(OPTIMIZER_TYPES)}")
        kind = kind.lower()
        raw = section.get("params", {})
        if not isinstance(raw, Mapping):
            raise _fail("optimizer.params", raw, "must be a JSON object")
        _check_keys(raw, "optimizer.params.", OPTIMIZER_PARAMS[kind])
        params: dict[str, Any] = {}
        if "lr" in raw:
            params["lr"] = _float("optimizer.params.lr", raw["lr"], minimum=0.0)
        if "weight_decay" in raw:
            params["weight_decay"] = _float(
                "optimizer.params.weight_decay", raw["weight_decay"], minimum=0.0
            )
        if "eps" in raw:
            params["eps"] = _float("optimizer.params.eps", raw["eps"], minimum=0.0, inclusive=False)
        if "betas" in raw:
            betas = raw["betas"]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise _fail("optimizer.params.betas", betas, "must be a list of two numbers")
            for beta in betas:
                value = _float("optimizer.params.betas", beta, minimum=0.0)
                if value >= 1.0:
                    raise _fail("optimizer.params.betas", betas, "each beta must be in [0, 1)")
            params["betas"] = (float(betas[0]), float(betas[1]))
        for key in ("adam_w_mode", "torch_adam", "nesterov"):
            if key in raw:
                params[key] = _bool(f"optimizer.params.{key}", raw[key])
        for key in ("momentum", "dampening"):
            if key in raw:
                params[key] = _float(f"optimizer.params.{key}", raw[key], minimum=0.0)
        return cls(type=kind, params=MappingProxyType(params))


# --------------------------------------------------------------------------- #
# fp16 loss scaling
# --------------------------------------------------------------------------- #

MAX_INITIAL_SCALE_POWER = 127
"""2**127 is the largest power of two a float32 loss scale can hold."""


@dataclass(frozen=True)
class LossScaleConfig:
    """The `fp16` section's loss-scaling keys, with DeepSpeed's defaults.

    `static_scale` 0 (`loss_scale` absent or 0) means dynamic scaling from
    ``2**initial_scale_power``; any other value is a fixed scale."""

    static_scale: float = 0.0
    """`loss_scale`: 0 for dynamic loss scaling, else this fixed scale."""
    initial_scale_power: int = 16
    """`initial_scale_power`: dynamic scaling starts at 2**this."""
    window: int = 1000
    """`loss_scale_window`: clean steps after which the dynamic scale doubles."""
    hysteresis: int = 2
    """`hysteresis`: overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: bool = False
    """`consecutive_hysteresis`: refill the hysteresis on every clean step."""
    min_scale: int = 1
    """`min_loss_scale`: the dynamic scale never falls below this."""

    @property
    def dynamic(self) -> bool:
        return self.static_scale == 0

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> LossScaleConfig:
        """Read an `fp16` section (already checked for unknown keys)."""
        power = _as_int(
            "fp16.initial_scale_power",
            section.get("initial_scale_power", 16),
            f"must be an integer from 0 to {MAX_INITIAL_SCALE_POWER}",
        )
        if not 0 <= power <= MAX_INITIAL_SCALE_POWER:
            raise _fail(
                "fp16.initial_scale_power",
                power,
                f"must be an integer from 0 to {MAX_INITIAL_SCALE_POWER} "
                "(the scale 2**power must be a finite float32)",
            )
        return cls(
            static_scale=_static_scale(section.get("loss_scale", 0)),
            initial_scale_power=power,
            window=_positive_int("fp16.loss_scale_window", section.get("loss_scale_window", 1000)),
            hysteresis=_positive_int("fp16.hysteresis", section.get("hysteresis", 2)),
            consecutive_hysteresis=_bool(
                "fp16.consecutive_hysteresis", section.get("consecutive_hysteresis", False)
            ),
            min_scale=_positive_int("fp16.min_loss_scale", section.get("min_loss_scale", 1)),
        )


def _static_scale(value: Any) -> float:
    scale = _float("fp16.loss_scale", value, minimum=0.0)
    if scale > 2.0**MAX_INITIAL_SCALE_POWER:
        raise _fail(
            "fp16.loss_scale",
            value,
            f"must be at most 2**{MAX_INITIAL_SCALE_POWER} (0 for dynamic loss scaling)",
        )
    return scale


# --------------------------------------------------------------------------- #
# The whole config
# --------------------------------------------------------------------------- #

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class QwzConfig:
    """Validated, immutable settings read from a DeepSpeed-style config."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """The `zero_optimization` section."""
    micro_batch_size: int | None = None
    """`train_micro_batch_size_per_gpu`, when given."""
    train_batch_size: int | None = None
    """`train_batch_size`, checked against micro batch x accumulation x world size by the engine."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; `engine.step()` steps on every k-th call."""
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    dtype: str = "fp32"
    """Working (replica) dtype: `fp32`, `bf16` (`bf16.enabled`) or `fp16` (`fp16.enabled`)."""
    optimizer: OptimizerConfig | None = None
    """The `optimizer` section; the engine requires it."""
    seed: int | None = None
    """`seed`, when given."""
    communication_dtype: str | None = None
    """`communication_data_type` (`fp16`, `bf16`, `fp32`): the dtype gradients are reduced
    in. None: the working dtype, which is what DeepSpeed's ZeRO-1/2 uses then."""
    grad_accum_dtype: str | None = None
    """`data_types.grad_accum_dtype` (`fp16`, `bf16`, `fp32`): the dtype of the gradient
    accumulators between micro-batches. None: fp32 (DeepSpeed would use the working dtype;
    qwz keeps the more accurate default, which moves no extra bytes on the wire)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """The `fp16` section's loss scaling (used only when `dtype` is fp16)."""
    auto_cast: bool = False
    """`fp16.auto_cast`: the engine casts floating-point inputs to fp16 before forward."""

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def quantized_weights(self) -> bool:
        return self.zero.quantized_weights.enabled

    @property
    def group_size(self) -> int:
        return self.zero.quantized_weights.group_size

    @classmethod
    def from_deepspeed(cls, source: Mapping[str, Any] | str | pathlib.Path) -> QwzConfig:
        """Validate a DeepSpeed config given as a dict, a JSON file path, or JSON text.

        Raises only ConfigError, with a message of bounded length."""
        try:
            return cls._from_config(load_json_config(source))
        except ConfigError:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as error:
            # A value no rule anticipated (say a 5,000-digit integer where a string is
            # expected): still a config error, never a traceback from deep inside.
            raise ConfigError(
                f"config: a value could not be validated ({type(error).__name__}: "
                f"{bounded_repr(str(error), 120)})"
            ) from None

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> QwzConfig:
        _check_keys(config, "", TOP_KNOWN)
        for key in TOP_UNSUPPORTED:
            if key in config and not _unsupported_is_off(key, config[key]):
                raise _not_supported(key, config[key])
        bf16 = _precision_section(config, "bf16", BF16_KNOWN)
        fp16 = _precision_section(config, "fp16", FP16_KNOWN)
        if bf16 and fp16:
            raise ConfigError(
                "bf16.enabled and fp16.enabled: True and True is invalid: "
                "at most one may be enabled"
            )
        # As in DeepSpeed, the loss-scaling values are read only when fp16 is enabled.
        fp16_section = config.get("fp16") if fp16 else {}
        if fp16 and fp16_section.get("fp16_master_weights_and_grads", False) is not False:
            raise _not_supported(
                "fp16.fp16_master_weights_and_grads",
                fp16_section["fp16_master_weights_and_grads"],
                "qwz keeps fp32 master weights and gradients",
            )
        micro = config.get("train_micro_batch_size_per_gpu")
        train = config.get("train_batch_size")
        seed = config.get("seed")
        return cls(
            zero=ZeroConfig.from_section(config.get("zero_optimization", {})),
            micro_batch_size=None
            if micro is None
            else _positive_int("train_micro_batch_size_per_gpu", micro),
            train_batch_size=None if train is None else _positive_int("train_batch_size", train),
            gradient_accumulation_steps=_positive_int(
                "gradient_accumulation_steps", config.get("gradient_accumulation_steps", 1)
            ),
            gradient_clipping=_float(
                "gradient_clipping", config.get("gradient_clipping", 0.0), minimum=0.0
            ),
            dtype="bf16" if bf16 else "fp16" if fp16 else "fp32",
            optimizer=None
            if config.get("optimizer") is None
            else OptimizerConfig.from_section(config["optimizer"]),
            seed=None if seed is None else _as_int("seed", seed, "must be an integer"),
            communication_dtype=_data_type(
                "communication_data_type", config.get("communication_data_type")
            ),
            grad_accum_dtype=_grad_accum_dtype(config.get("data_types")),
            loss_scale=LossScaleConfig.from_section(fp16_section),
            auto_cast=_bool("fp16.auto_cast", fp16_section.get("auto_cast", False)),
        )


DATA_TYPES = ("fp16", "bf16", "fp32")
"""Values DeepSpeed accepts for `communication_data_type` and `data_types.grad_accum_dtype`."""


def _data_type(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if value not in DATA_TYPES:
        raise _fail(key, value, f"must be one of {', '.join(DATA_TYPES)} (or absent)")
    return value


def _grad_accum_dtype(section: Any) -> str | None:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise _fail(
            "data_types", section, 'must be a JSON object such as {"grad_accum_dtype": "fp32"}'
        )
    _check_keys(section, "data_types.", ("grad_accum_dtype",))
    return _data_type("data_types.grad_accum_dtype", section.get("grad_accum_dtype"))


def _unsupported_is_off(key: str, value: Any) -> bool:
    if key == "prescale_gradients":
        return value is False
    if key == "gradient_predivide_factor":
        return value == 1.0 and not isinstance(value, bool)
    if key == "sequence_parallel_size":
        return value == 1 and not isinstance(value, bool)
    return _switched_off(key, value)


def _precision_section(config: Mapping[str, Any], key: str, known: tuple[str, ...]) -> bool:
    section = config.get(key)
    if section is None:
        return False
    if not isinstance(section, Mapping):
        raise _fail(key, section, 'must be a JSON object such as {"enabled": true}')
    _check_keys(section, f"{key}.", known)
    return _bool(f"{key}.enabled", section.get("enabled", False))


def load_json_config(source: Mapping[str, Any] | str | pathlib.Path) -> dict[str, Any]:
    """Read a config dict from a dict, a JSON file path or JSON text.

    Text and files go through ``qwz.jsonio`` ([Note: bounded JSON]): regular files only,
    bounded size, depth, integers and lists, duplicate keys and NaN/Infinity refused."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str) and not source.strip():
        raise ConfigError("config: an empty string is neither JSON text nor a path to a JSON file")
    try:
        if isinstance(source, pathlib.Path) or (
            isinstance(source, str) and not source.lstrip().startswith(("{", "["))
        ):
            origin = f"config file {bounded_repr(str(source), 200)}"
            loaded = read_json_file(source, what="config file")
        elif isinstance(source, str):
            origin = "config JSON text"
            loaded = parse_json_text(source, origin=origin)
        else:
            raise ConfigError(
                f"config: {type(source).__name__} is invalid: pass a dict, a JSON path or JSON text"
            )
    except JsonInputError as error:
        raise ConfigError(f"config: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {origin} must hold a JSON object, not {type(loaded).__name__}")
    return loaded
