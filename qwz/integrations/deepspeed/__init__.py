"""qwz's bounded, quantized weight gather inside DeepSpeed's own ZeRO-1/2 optimizer.

DeepSpeed 0.19 accepts ``zero_quantized_weights: true`` at stages 1 and 2 and
does nothing with it, and its config schema rejects
``zero_quantized_weights_group_size``. :func:`initialize` is a drop-in for
``deepspeed.initialize`` that makes the setting real for the engine it returns::

    from qwz.integrations import deepspeed as qwz_deepspeed
    engine, optimizer, loader, scheduler = qwz_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config)

Supported: DeepSpeed >= 0.19, < 0.20 (:data:`SUPPORTED_DEEPSPEED`), stages 1
and 2, bf16, fp16 (with DeepSpeed's loss scaling: an overflow step skips the
gather as stock does) and fp32 weights, on the dp process group DeepSpeed
picks for each param group: the whole world for dense parameters, the
expert-data-parallel group for the experts of DeepSpeed's MoE layers (tested in
tests/multigpu/test_deepspeed_moe.py; a group of one rank is copied exactly).

The package is split by job: :mod:`.config` (where the config comes from, version and
feature refusals), :mod:`.takeover` (:func:`initialize` and the replaced methods),
:mod:`.gather` (qwz's gather over DeepSpeed's flat groups), :mod:`.resume` (the fp32
masters from the checkpoint on a weights-only load, or a refusal), :mod:`.detector` (the
silent-no-op detector) and :mod:`.shards` ([Note: own shards] over DeepSpeed's layout, for
stock and taken-over optimizers alike).
"""

from __future__ import annotations

from qwz.integrations.deepspeed import config, detector, gather, resume, takeover
from qwz.integrations.deepspeed.config import GATHER_ENV, SUPPORTED_DEEPSPEED, version_tuple
from qwz.integrations.deepspeed.detector import (
    WeightGatherCheck,
    measure_weight_gather,
    require_quantized_weights,
    unquantized_gather_bytes,
)
from qwz.integrations.deepspeed.gather import (
    FlatGroupPlan,
    gather_flat_group,
    gather_optimizer_weights,
    plan_flat_group,
)
from qwz.integrations.deepspeed.resume import LossyResumeError
from qwz.integrations.deepspeed.takeover import initialize

_version_tuple = version_tuple  # the name the tests have always used

__all__ = [
    "GATHER_ENV",
    "SUPPORTED_DEEPSPEED",
    "FlatGroupPlan",
    "LossyResumeError",
    "WeightGatherCheck",
    "config",
    "detector",
    "gather",
    "gather_flat_group",
    "gather_optimizer_weights",
    "initialize",
    "measure_weight_gather",
    "plan_flat_group",
    "require_quantized_weights",
    "resume",
    "takeover",
    "unquantized_gather_bytes",
]
