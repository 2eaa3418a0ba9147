"""The run settings, read from their one declaration (``RunPlan`` and ``Launch`` in
qualify/base/plan.py, [Note: one declaration per setting] in qualify/base/values.py) and
turned into what each interface needs: the ``run`` flags and their help, a preset's overrides
and the matrix spec's keys and cell arguments (run_request.py resolves a parsed command line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qwz.qualify.base import presets
from qwz.qualify.base.plan import Launch, RunPlan
from qwz.qualify.base.values import (
    SETTING,
    Boolean,
    GroupSize,
    Integer,
    OneOf,
    Optional,
    Path,
    Real,
    Rule,
    Setting,
)

RENAMED_FLAGS = {
    "--bucket-size": ("--allgather-bucket-size N --reduce-bucket-size N", 1),
    "--compile": ("--kernels fused", 0),
    "--no-compile": ("--kernels eager", 0),
    "--no-integration": ("--no-qwz-gather", 0),
    "--initial-scale-power": ("--fp16-initial-scale-power", 1),
}
"""Flags of earlier versions -> (what replaced them, how many values they took): refused with
the replacement named, so a script written for the old flag is told, never misread."""


@dataclass(frozen=True)
class RunSetting:
    """One run setting as its interfaces see it."""

    name: str
    default: Any
    declaration: Setting
    rule: Rule
    """The declaration's rule with its vocabulary resolved (the workloads, the presets)."""
    in_plan: bool
    """A field of ``RunPlan`` (else of ``Launch``)."""

    @property
    def flag(self) -> str:
        return self.declaration.flag or "--" + self.name.replace("_", "-")

    @property
    def matrix(self) -> str | None:
        return self.declaration.matrix

    def check(self, value: Any) -> Any:
        """A Python (TOML, preset) value of this setting, checked; ValueError if refused."""
        if not self.declaration.repeated:
            return self.rule.check(value)
        values = value if isinstance(value, list | tuple) else [value]
        if not values:
            raise ValueError("[] is invalid: give at least one value")
        checked = tuple(self.rule.check(item) for item in values)
        if len(set(checked)) != len(checked):
            raise ValueError(f"{list(values)!r} is invalid: a value repeats")
        return checked

    def arguments(self, value: Any) -> list[str]:
        """The ``run`` arguments that set this setting to `value`."""
        if self.declaration.repeated:
            return [item for element in value for item in (self.flag, str(element))]
        if isinstance(self.rule, Boolean):
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        return [self.flag, repr(value) if isinstance(value, float) else str(value)]


def _vocabularies() -> dict[str, tuple[str, ...]]:
    from qwz.qualify.run.workloads import WORKLOAD_NAMES

    return {"workload": WORKLOAD_NAMES, "preset": presets.PRESET_NAMES}


def declared_in(types: Iterable[type]) -> dict[str, RunSetting]:
    """Name -> setting, for every field declared with ``setting()`` in `types`, in order."""
    vocabularies = _vocabularies()
    found: dict[str, RunSetting] = {}
    for owner in types:
        for field in dataclasses.fields(owner):
            declaration = field.metadata.get(SETTING)
            if declaration is None:
                continue
            default = field.default
            if default is dataclasses.MISSING:  # the default preset supplies it (the workload)
                default = presets.PRESETS[presets.DEFAULT].values[field.name]
            rule = declaration.rule
            if isinstance(rule, OneOf):
                rule = rule.resolved(vocabularies)
            found[field.name] = RunSetting(field.name, default, declaration, rule, owner is RunPlan)
    return found


@functools.cache
def run_settings() -> dict[str, RunSetting]:
    """Every setting of ``qwz-qualify run``."""
    return declared_in((RunPlan, Launch))


# --------------------------------------------------------------------------- #
# The command line
# --------------------------------------------------------------------------- #


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use {RENAMED_FLAGS[option_string][0]}")


def argparse_type(rule: Rule):
    """An argparse ``type`` that parses with `rule`, its refusal argparse's message."""

    def parse(text: str) -> Any:
        try:
            return rule.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _help(setting: RunSetting, shown_default: str | None = None) -> str:
    """The declaration's help, the default (`shown_default` where a command other than
    ``run`` has its own) and every preset's own value."""
    default = setting.default
    shown = default
    if shown_default is not None:
        shown = shown_default
    elif default is None:
        shown = "none"
    elif setting.declaration.repeated:
        shown = " ".join(map(str, default))
    overrides = [
        f"{name}: {preset.values[setting.name]}"
        for name, preset in presets.PRESETS.items()
        if setting.name in preset.values and preset.values[setting.name] != default
    ]
    overrides += [
        f"{name} with a GPU per rank: {preset.gpu_values[setting.name]}"
        for name, preset in presets.PRESETS.items()
        if setting.name in preset.gpu_values
    ]
    presets_text = f"; preset {', '.join(overrides)}" if overrides else ""
    return f"{setting.declaration.help} (default: {shown}{presets_text})"


def _metavar(rule: Rule) -> str:
    if rule.choices:
        return "{" + ",".join(rule.choices) + "}"
    inner = rule.rule if isinstance(rule, Optional) else rule
    return {Path: "PATH", GroupSize: "G", Integer: "N", Real: "X"}.get(type(inner), "VALUE")


def add_flags(
    parser: argparse.ArgumentParser,
    settings: Mapping[str, RunSetting],
    shown_defaults: Mapping[str, str] | None = None,
) -> None:
    """A flag per setting (every default None: run_request.given_settings tells given from
    unset), and the renamed flags of earlier versions, refused naming their replacement.
    `shown_defaults`: the default a command's help shows for a setting where the command sets
    its own (name -> text)."""
    for setting in settings.values():
        shown = (shown_defaults or {}).get(setting.name)
        options: dict[str, Any] = {
            "dest": setting.name,
            "default": None,
            "help": _help(setting, shown),
        }
        if isinstance(setting.rule, Boolean):
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = argparse_type(setting.rule)
            options["metavar"] = _metavar(setting.rule)
            if setting.declaration.repeated:
                options["action"] = "append"
        parser.add_argument(setting.flag, **options)
    for flag, (_, nargs) in RENAMED_FLAGS.items():
        parser.add_argument(
            flag, action=_Renamed, nargs=nargs, dest=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
