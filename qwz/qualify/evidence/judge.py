"""The judge's identity, sealed inside every record's digest (``Record.judge``).

[Note: judge identity]
A verdict is only as meaningful as the rules it was reached under, so a record names them: qwz's
version, every check family's rule version (rules.RULES), the sha256 of the normative constants
(``CONSTANTS``: margins, thresholds, the spec's numbers, the bootstrap's seed and resamples, the
horizon's constants), one such digest per rule, and the statistics libraries' versions. Two
judges with equal rule versions must give every record the same statuses and numbers
(rejudge.py holds loading to that); a constant is part of a rule, so changing one without
bumping its rule's version is caught by the golden file::

    tests/unit/qualify/golden/judge-rules.json

which holds each rule's version and its constants' digest (test_judge.py fails, naming the rule
to bump). Regenerate it after bumping with::

    python -m qwz.qualify.evidence.judge GOLDEN
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pathlib
import sys
from importlib import metadata
from typing import Any

import qwz
from qwz.qualify.evidence import checks  # noqa: F401  (registers every @rule
from qwz.qualify.evidence.rules import RULES, SPEED
from qwz.qualify.evidence.schema import Judge

_EVIDENCE = "qwz.qualify.evidence"

CONSTANTS: dict[str, tuple[str, ...]] = {
    "finite": (),
    "step1-exact": (),
    "update": (),
    "overflow-pattern": ("rules.overflow_pattern.SCALE_FACTOR", "rules.overflow_pattern.DEFAULTS"),
    "own-shard": (
        "spec.CODE_MAX",
        "spec.MIN_SCALE",
        "spec.EXACT_MAX_NUMEL",
        "spec.TIE_ALLOWANCE",
        "spec.SCALE_ULPS",
        "spec.QUANTIZATION_INPUTS",
        "contract.SCHEMES",
        "zeropp.CODE_MIN",
        "zeropp.CODE_MAX",
        "zeropp.FP16_MAX",
        "zeropp.TIE_ALLOWANCE",
        "zeropp.DECODE_ALLOWANCE",
    ),
    "replicas": (),
    "reproduced": (),
    "probe": (
        "spec.SCALE_BYTES",
        "spec.CODE_BYTES",
        "spec.EXACT_MAX_NUMEL",
        "wire.ALIGNMENT_BYTES",
        "wire.EXACT_SIDE_CHANNEL_BYTES",
        "wire.ROW_SLACK_BYTES",
    ),
    "in-effect": (),
    "bounded": (
        "spec.SCALE_BYTES",
        "staging.EXACT_VALUE_BYTES",
        "staging.ROW_ALIGNMENT_BYTES",
        "staging.IN_FLIGHT_COLLECTIVES",
        "staging.WORKSPACE_FP32_COPIES",
        "staging.INDEX_BYTES",
        "staging.MASK_BYTES",
        "staging.MEMORY_KINDS_JUDGED",
    ),
    "learning": (
        "rules.learning.MIN_REFERENCE_DROP",
        "rules.learning.MARGIN_FACTOR",
        "rules.learning.MARGIN_FLOOR",
        "rules.horizon.WINDOW_SHARE",
        "rules.horizon.MIN_WINDOW_EVALUATIONS",
        "rules.horizon.MIN_BATCHES",
        "rules.horizon.CONFIDENCE",
        "rules.horizon.MARGIN_FACTOR",
        "rules.horizon.MARGIN_FLOOR",
    ),
    "speedup": ("rules.speed.MIN_BLOCKS_FOR_INTERVAL",),
    "conformance": ("rules.conformance.NORMATIVE",),
    SPEED: (
        "rules.speed.MIN_BLOCKS_FOR_INTERVAL",
        "stats.DEFAULT_CONFIDENCE",
        "stats.DEFAULT_RESAMPLES",
        "stats.DEFAULT_SEED",
    ),
}
"""Rule family -> the normative constants it reads (``module.NAME`` under qualify/evidence)."""

LIBRARIES = ("scipy", "numpy")
GOLDEN = pathlib.Path(__file__).resolve().parents[3] / "tests/unit/qualify/golden/judge-rules.json"


def constant_values(family: str) -> dict[str, Any]:
    """The current values of ``family``'s constants, JSON-able (``repr`` of floats keeps every
    bit: 2**-126 and its neighbour differ)."""
    values = {}
    for dotted in CONSTANTS[family]:
        module, name = dotted.rsplit(".", 1)
        value = getattr(importlib.import_module(f"{_EVIDENCE}.{module}"), name)
        values[dotted] = json.loads(json.dumps(value, default=repr, sort_keys=True))
        if isinstance(value, float):
            values[dotted] = repr(value)
    return values


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def rule_digests() -> dict[str, str]:
    missing = sorted(set(RULES) ^ set(CONSTANTS))
    if missing:
        raise RuntimeError(
            f"judge.CONSTANTS and rules.RULES name different families: {', '.join(missing)}"
        )
    return {family: _digest(constant_values(family)) for family in sorted(RULES)}


def _library_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def current() -> Judge:
    """Today's judge."""
    per_rule = rule_digests()
    return Judge(
        version=qwz.__version__,
        rules=dict(sorted(RULES.items())),
        constants_sha256=_digest(per_rule),
        rule_constants_sha256=per_rule,
        libraries={name: _library_version(name) for name in LIBRARIES},
    )


def golden() -> dict[str, Any]:
    """What the golden file holds: per rule, its version, its constants and their digest."""
    digests = rule_digests()
    return {
        family: {
            "version": RULES[family],
            "constants": constant_values(family),
            "sha256": digests[family],
        }
        for family in sorted(RULES)
    }


def unbumped(stored: dict[str, Any]) -> list[str]:
    """One line per rule whose constants changed against the golden ``stored`` while its
    version did not: which constants, and the version to bump to."""
    problems = []
    for family, today in golden().items():
        then = stored.get(family)
        if then is None or then["sha256"] == today["sha256"]:
            continue
        changed = sorted(
            name
            for name in set(then["constants"]) | set(today["constants"])
            if then["constants"].get(name) != today["constants"].get(name)
        )
        if then["version"] == today["version"]:
            problems.append(
                f"rule {family!r}: its constants changed ({', '.join(changed)}) but its version "
                f"did not: bump RULES[{family!r}] to {today['version'] + 1} "
                f"(@rule({family!r}, {today['version'] + 1}) in its module under "
                "qualify/evidence/rules/), "
                "then regenerate with `python -m qwz.qualify.evidence.judge GOLDEN`"
            )
    return problems


def main(argv: list[str]) -> int:
    if argv != ["GOLDEN"]:
        print("usage: python -m qwz.qualify.evidence.judge GOLDEN", file=sys.stderr)
        return 2
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
