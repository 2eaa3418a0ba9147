"""``qwz-qualify run --ds-config FILE``: the user's DeepSpeed config as the base of every arm.

[Note: the user's DeepSpeed config]
With ``--ds-config FILE`` every arm's config (``RunPlan.arm_config``) is the file's JSON
object with only this set over it:

* per arm, ``zero_optimization.zero_quantized_weights`` and, on a candidate, its
  ``zero_quantized_weights_group_size``: what the harness varies. A file that sets either
  key is refused, since no one value serves the reference and the candidates;
* ``zero_optimization.stage`` and the precision (``bf16.enabled``, ``fp16.enabled``): the
  run's stage and dtype;
* ``train_micro_batch_size_per_gpu`` (the workload's micro-batch) and
  ``gradient_accumulation_steps`` 1: the harness feeds one workload batch per rank and step
  and judges one optimizer step per training step, so a file that says otherwise (or a
  ``train_batch_size`` other than micro-batch x ranks) is refused;
* only where the file has no such section: the harness's ``optimizer`` (AdamW from
  ``--lr``, ``--weight-decay``, ``--torch-adam``), and in an fp16 run its ``fp16`` loss
  scaling (``--fp16-*``);
* a setting of ``MAPPED`` given on the command line whose key the file leaves out.

Everything else is the file's -- the optimizer, the buckets, the clipping, the loss scaling,
any other key -- and what it leaves out is DeepSpeed's default, as DeepSpeed reads the file.
Every arm is built on the same file, so the arms differ only in what the harness varies and
``step1-exact`` holds as it does without a file.

A run setting that is a key of the file (``MAPPED``, the stage, the dtype) follows one rule:
given on the command line and in the file with another value, the run is refused (exit 2,
before any rank starts), naming the key, the file's value and the flag's; only in the file,
the file's value wins and the run's setting takes it, so the record's plan says what ran
(a preset's value gives way to the file too); in neither, the stage and the dtype are the
run's, and the other settings record DeepSpeed's default, which is what runs. The file is
read once, before any rank starts, with the bounded JSON reader (``qwz.jsonio``); the
record's plan keeps its path, the sha256 of its bytes and its JSON content (``ds_config``).
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Mapping
from typing import Any

from qwz import jsonio
from qwz.qualify.base.plan import DeepSpeedConfigFile
from qwz.qualify.evidence.optimizer import AdamWSettings, adamw_of
from qwz.qualify.evidence.rules import overflow_pattern

QUANTIZED_WEIGHTS = "zero_optimization.zero_quantized_weights"
GROUP_SIZE = "zero_optimization.zero_quantized_weights_group_size"
STAGE = "zero_optimization.stage"
DEEPSPEED_BUCKET_DEFAULT = 500_000_000
"""DeepSpeed's ``allgather_bucket_size`` and ``reduce_bucket_size`` where a config leaves
them out."""
FP16_DEFAULTS = overflow_pattern.DEFAULTS
MAPPED: dict[str, tuple[str, Any]] = {
    "allgather_bucket_size": ("zero_optimization.allgather_bucket_size", DEEPSPEED_BUCKET_DEFAULT),
    "reduce_bucket_size": ("zero_optimization.reduce_bucket_size", DEEPSPEED_BUCKET_DEFAULT),
    "gradient_clipping": ("gradient_clipping", 0.0),
    "lr": ("optimizer.params.lr", None),
    "weight_decay": ("optimizer.params.weight_decay", None),
    "torch_adam": ("optimizer.params.torch_adam", False),
    "fp16_initial_scale_power": ("fp16.initial_scale_power", FP16_DEFAULTS["initial_scale_power"]),
    "fp16_loss_scale_window": ("fp16.loss_scale_window", FP16_DEFAULTS["loss_scale_window"]),
    "fp16_hysteresis": ("fp16.hysteresis", FP16_DEFAULTS["hysteresis"]),
}
"""Run setting -> (its key in the config, dotted; DeepSpeed's default where the file leaves
it out, None: the default of the file's Adam, [Note: the optimizer the update check
re-derives]). A key under ``optimizer`` or ``fp16`` is the file's only where the file has
that section."""


def _lookup(content: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(whether the file has the key, its value)."""
    value: Any = content
    for name in dotted.split("."):
        if not isinstance(value, Mapping) or name not in value:
            return False, None
        value = value[name]
    return True, value


def read(path: pathlib.Path) -> DeepSpeedConfigFile:
    """The file at `path`, read with the bounded JSON reader; ValueError, one line naming the
    file and what is wrong, for a file that is not a JSON object with object sections."""
    try:
        data = jsonio.read_regular_file(
            path, max_bytes=jsonio.DEFAULT_LIMITS.max_bytes, what="DeepSpeed config"
        )
        content = jsonio.parse_json_bytes(data, origin=str(path))
    except jsonio.JsonInputError as error:
        raise ValueError(f"--ds-config {error}") from None
    if not isinstance(content, dict):
        raise ValueError(
            f"--ds-config {path}: holds a JSON {type(content).__name__}, not an object"
        )
    for section in ("zero_optimization", "optimizer", "bf16", "fp16"):
        if section in content and not isinstance(content[section], dict):
            raise ValueError(
                f"--ds-config {path}: {section} is {jsonio.bounded_repr(content[section], 60)}; "
                "must be a JSON object"
            )
    digest = hashlib.sha256(data).hexdigest()
    return DeepSpeedConfigFile(str(path.resolve()), digest, content)


def file_dtype(content: Mapping[str, Any]) -> str | None:
    """The working dtype the file's precision sections ask for; None where it has none.
    ValueError for ``bfloat16`` (DeepSpeed's other name of ``bf16``), an ``enabled`` that is
    not true or false, or two precisions enabled."""
    if "bfloat16" in content:
        raise ValueError(
            "bfloat16 is in the file: write it as bf16 (the harness sets bf16.enabled from "
            "the run's dtype)"
        )
    present = [name for name in ("bf16", "fp16") if name in content]
    enabled = []
    for name in present:
        value = content[name].get("enabled", False)
        if type(value) is not bool:
            raise ValueError(f"{name}.enabled is {value!r} in the file; must be true or false")
        if value:
            enabled.append(name)
    if len(enabled) > 1:
        raise ValueError("bf16.enabled and fp16.enabled are both true in the file")
    if not present:
        return None
    return enabled[0] if enabled else "fp32"


def _shown(value: Any) -> str:
    """A value as the file writes it (JSON's true and false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return jsonio.bounded_repr(value, 60)


def arm_problems(content: Mapping[str, Any], arm_names: list[str]) -> list[str]:
    """The quantization keys the harness varies per arm, where the file sets them: each
    contradicts an arm ([Note: the user's DeepSpeed config])."""
    problems = []
    has, value = _lookup(content, QUANTIZED_WEIGHTS)
    if has:
        needing = "false" if value else "true"
        arm = arm_names[0] if value else next((a for a in arm_names if "candidate" in a), "")
        problems.append(
            f"{QUANTIZED_WEIGHTS} is {_shown(value)} in the file; the {arm} arm needs "
            f"{needing} (the harness sets it per arm: leave it out)"
        )
    has, value = _lookup(content, GROUP_SIZE)
    if has:
        problems.append(
            f"{GROUP_SIZE} is {_shown(value)} in the file; the {arm_names[0]} arm sets none "
            "and each candidate its own group size (the harness sets it per arm: leave it out)"
        )
    return problems


def batch_problems(content: Mapping[str, Any], micro_batch: int, world_size: int) -> list[str]:
    """The batch keys the harness needs as it feeds the ranks ([Note: the user's DeepSpeed
    config])."""
    needed = {
        "train_micro_batch_size_per_gpu": (micro_batch, "the workload's micro-batch"),
        "gradient_accumulation_steps": (1, "one optimizer step per batch, as the harness steps"),
        "train_batch_size": (
            micro_batch * world_size,
            f"micro-batch {micro_batch} x {world_size} ranks",
        ),
    }
    return [
        f"{key} is {_shown(content[key])} in the file; the run needs {value} ({why})"
        for key, (value, why) in needed.items()
        if key in content and content[key] != value
    ]


def _effective_optimizer(content: Mapping[str, Any]) -> dict[str, Any]:
    """lr and weight decay of the file's Adam where it leaves them out, DeepSpeed's way."""
    settings = adamw_of(content)
    if not isinstance(settings, AdamWSettings):
        return {}
    return {"lr": settings.lr, "weight_decay": settings.weight_decay}


def mapped_values(
    content: Mapping[str, Any], given: Mapping[str, Any], settings: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """For each ``MAPPED`` setting: the value the run takes (the file's, else DeepSpeed's
    default; never for one given), the keys set from flags the file leaves out, and one
    refusal per setting the file contradicts. `given`: the settings given on the command
    line; `settings`: name -> its ``RunSetting`` (qualify/request/settings.py)."""
    values: dict[str, Any] = {}
    from_flags: dict[str, Any] = {}
    problems: list[str] = []
    adam_defaults = []  # left out, and DeepSpeed's default is the file's Adam's
    for name, (dotted, default) in MAPPED.items():
        section = dotted.split(".")[0]
        if "." in dotted and section != "zero_optimization" and section not in content:
            continue  # the harness's own section is used: the run's settings hold
        has, value = _lookup(content, dotted)
        if not has:
            if name in given:
                from_flags[dotted] = given[name]
            elif default is not None:
                values[name] = default
            else:
                adam_defaults.append(name)
            continue
        try:
            value = settings[name].check(_as_setting(value, default))
        except ValueError as error:
            problems.append(f"{dotted} in the file: {error}")
            continue
        if name in given and given[name] != value:
            flag = " ".join(settings[name].arguments(given[name]))
            problems.append(f"{dotted} is {_shown(value)} in the file; {flag} was given")
        values[name] = value
    defaults = _effective_optimizer(content) if adam_defaults else {}
    values.update({name: defaults[name] for name in adam_defaults if name in defaults})
    return values, from_flags, problems


def _as_setting(value: Any, default: Any) -> Any:
    """A JSON number as the setting holds it: ``1e8`` for an integer setting is 100000000."""
    integer = isinstance(default, int) and not isinstance(default, bool)
    if integer and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def apply(
    values: Mapping[str, Any], given: Mapping[str, Any], micro_batch: int, world_size: int
) -> tuple[dict[str, Any], list[str]]:
    """[Note: the user's DeepSpeed config] over the run's settings `values` (name -> value;
    `given`: those given on the command line), as ``run_request.resolve`` reads them: the
    settings the file holds take its values, and ``ds_config`` becomes the
    ``DeepSpeedConfigFile``; and one line per refusal."""
    path = values["ds_config"]
    if path is None:
        return dict(values), []
    try:
        loaded = read(path)
        dtype = file_dtype(loaded.content)
    except ValueError as error:
        text = str(error)
        return dict(values), [
            text if text.startswith("--ds-config") else f"--ds-config {path}: {text}"
        ]
    content = loaded.content
    from qwz.qualify.request.settings import run_settings

    settings = run_settings()
    arms = ["reference", *(f"candidate-g{size}" for size in values["group_sizes"])]
    quantization_problems = arm_problems(content, arms)
    problems = batch_problems(content, micro_batch, world_size)
    axes, axis_problems = _axis_values(content, dtype, given, settings["stage"].check)
    mapped, from_flags, mapped_problems = mapped_values(content, given, settings)
    problems += axis_problems + mapped_problems + quantization_problems
    if problems:
        return dict(values), [f"--ds-config {path}: {problem}" for problem in problems]
    ds_file = DeepSpeedConfigFile(loaded.path, loaded.sha256, content, from_flags)
    return {**values, **axes, **mapped, "ds_config": ds_file}, []


def _axis_values(
    content: Mapping[str, Any],
    dtype: str | None,
    given: Mapping[str, Any],
    check_stage: Any,
) -> tuple[dict[str, Any], list[str]]:
    """The stage and the dtype: the file's where the command line gives none, refused where
    it gives another."""
    values: dict[str, Any] = {}
    problems = []
    has, stage = _lookup(content, STAGE)
    if has:
        try:
            stage = check_stage(stage)
        except ValueError:
            return {}, [
                f"{STAGE} is {_shown(stage)} in the file; the run qualifies ZeRO stage 1 or 2"
            ]
        if "stage" in given and given["stage"] != stage:
            problems.append(f"{STAGE} is {stage} in the file; --stage {given['stage']} was given")
        values["stage"] = stage
    if dtype is not None:
        if "dtype" in given and given["dtype"] != dtype:
            said = {
                "bf16": "bf16.enabled is true in the file",
                "fp16": "fp16.enabled is true in the file",
                "fp32": "neither bf16.enabled nor fp16.enabled is true in the file",
            }[dtype]
            problems.append(f"{said} (dtype {dtype}); --dtype {given['dtype']} was given")
        values["dtype"] = dtype
    return values, problems
