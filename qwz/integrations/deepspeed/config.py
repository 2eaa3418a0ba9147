"""Config checks and refusals of the DeepSpeed drop-in: where the config comes from, whether
qwz takes over, and what it refuses.

[Note: refused configurations]
When qwz would take over (stage 1 or 2, ``zero_quantized_weights: true``,
takeover enabled), :func:`initialize` raises :class:`qwz.ConfigError`, before
DeepSpeed builds anything, for:

* a DeepSpeed version outside :data:`SUPPORTED_DEEPSPEED`: the replaced
  gather is an internal of ``stage_1_and_2.py`` that may move in any release;
* ``offload_optimizer`` / ``offload_param`` with a device other than none
  (or the deprecated ``cpu_offload*`` flags): the master and the bit16
  partition then live on the host and are copied through a staging buffer
  this gather does not know;
* ZenFlow: its optimizer is a subclass with its own gather and step order;
* bf16 at stage 1 with ``data_types.grad_accum_dtype: fp32``: DeepSpeed then
  builds its ``BF16_Optimizer``, not the ZeRO optimizer;
* and after ``deepspeed.initialize``, any optimizer object that is not exactly
  ``DeepSpeedZeroOptimizer`` with the attributes the gather reads.

Always, whatever the stage: the qwz-owned keys are validated with qwz's rules
(:meth:`qwz.config.QuantizedWeights.from_section`: a group size is a positive
multiple of 8, only 64 with stage 3; ``zero_quantized_weights`` needs a
stage) and removed before DeepSpeed sees them, since its schema rejects them.
``zero_quantized_weights`` itself is removed when qwz takes over (so DeepSpeed
does not also act on it) and kept otherwise: stage 3 uses DeepSpeed's own
qwZ, and with the takeover disabled (``initialize(..., qwz_gather=False)`` or
``QWZ_DEEPSPEED_GATHER=0``) the request reaches stock DeepSpeed, which ignores
it -- the silent no-op that :func:`measure_weight_gather` detects. A
non-default ``preserve_numel`` with stage 3 is refused: only qwz honours it.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import Any

from qwz.config import QUANTIZED_WEIGHTS_KEY, ConfigError, load_json_config, offload_enabled

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))
"""DeepSpeed versions qwz takes over: at least the first, below the second (major, minor)."""

GATHER_ENV = "QWZ_DEEPSPEED_GATHER"
"""Set to 0 / false / off to keep stock DeepSpeed even when quantized weights are requested."""


def take_config(arguments: dict[str, Any]) -> dict[str, Any] | None:
    """The config dict from wherever deepspeed.initialize would read it, ready to edit."""
    config = arguments.pop("config", None)
    legacy = arguments.pop("config_params", None)
    if config is None:
        config = legacy
    args = arguments.get("args")
    for attribute in ("deepspeed_config", "deepscale_config"):
        from_args = getattr(args, attribute, None)
        if from_args is not None and config is None:
            # The caller's namespace is left untouched: DeepSpeed gets a copy without it.
            args = copy.copy(args)
            setattr(args, attribute, None)
            arguments["args"] = args
            config = from_args
    if config is None:
        return None
    return copy.deepcopy(load_json_config(config))


def gather_enabled(qwz_gather: bool | None) -> bool:
    if qwz_gather is not None:
        return bool(qwz_gather)
    return os.environ.get(GATHER_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; (-1, -1) when it does not start with them."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (-1, -1)


def check_supported(
    version: str, config: Mapping[str, Any], zero: Mapping[str, Any], stage: int
) -> None:
    """[Note: refused configurations] that can be seen in the config."""
    low, high = SUPPORTED_DEEPSPEED
    if not low <= version_tuple(version) < high:
        raise ConfigError(
            f"deepspeed: version {version!r} is not supported by qwz.integrations.deepspeed "
            f"(supported: >={low[0]}.{low[1]}, <{high[0]}.{high[1]}); the replaced gather is "
            "an internal of deepspeed/runtime/zero/stage_1_and_2.py"
        )
    prefix = "zero_optimization."
    for key in ("offload_optimizer", "offload_param"):
        if offload_enabled(zero.get(key)):
            raise ConfigError(
                f"{prefix}{key}: {zero[key]!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
                "(offload keeps the master and the bit16 partition on the host; use device none)"
            )
    for key in ("cpu_offload", "cpu_offload_param"):
        if zero.get(key):
            raise ConfigError(
                f"{prefix}{key}: {zero[key]!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
                "(offload is not supported; set false)"
            )
    zenflow = zero.get("zenflow")
    if (
        zenflow is not None
        and zenflow is not False
        and not (isinstance(zenflow, Mapping) and zenflow.get("enabled") is False)
    ):
        raise ConfigError(
            f"{prefix}zenflow: {zenflow!r} is not supported with {QUANTIZED_WEIGHTS_KEY} "
            "(ZenFlow's optimizer has its own gather and step order)"
        )
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    grad_accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 1 and isinstance(bf16, Mapping) and bf16.get("enabled") and grad_accum == "fp32":
        raise ConfigError(
            f"data_types.grad_accum_dtype: {grad_accum!r} is not supported with "
            f"{QUANTIZED_WEIGHTS_KEY} at stage 1 with bf16 (DeepSpeed then builds its "
            "BF16_Optimizer, not the ZeRO optimizer qwz extends); remove it or use stage 2"
        )
