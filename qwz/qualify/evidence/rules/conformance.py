"""The PR's config rules as the judge states them, and the ``conformance`` check.

[Note: the PR's config rules]
Besides the wire format, DeepSpeed #8511 and #8513 state which configs the implementation
accepts:

- #8511: ZeRO stages 1 and 2 honour ``zero_quantized_weights``; FP32 and ZenFlow combined with
  it are rejected at optimizer initialization; the default ZeRO-1/2 path is unchanged.
- #8513: ``zero_quantized_weights_group_size`` defaults to 64, takes positive multiples of 8,
  a non-default size is rejected with ZeRO-3, and it is forwarded through the engine and the
  optimizer (what reaches the wire is ``probe``'s to judge, from the bytes).

``ROWS`` turns these into small DeepSpeed configs, each with the outcome the PR's text fixes:
``accept`` or ``refuse``, or ``open`` where the text leaves it open; an open row is shown as
context, never judged. The harness hands every row to the subject's own parser and, at stages
1 and 2 where the parser accepted it, to the subject's own engine for a tiny model at world
size 1 (qualify/run/conformance_run.py); the record keeps the outcome and the subject's message.
Where a refusal happens (parser or engine) is the implementation's choice: "rejected at
optimizer initialization" is met as well by a config validator that refuses earlier.

How the rows were decided:

- ``"64"`` (a JSON string) is open. The PR says "positive multiples of 8" and nothing about
  coercion; DeepSpeed's pydantic config is lax (0.19.8 takes ``reduce_bucket_size: "500"`` as
  500), so a PR written the DeepSpeed way (``int = Field(64, gt=0)``) accepts "64" as 64, and
  a strict parser refuses it: both are correct.
- ``true`` and ``7.5`` are refused: neither is an integer, and taken the lax way (``true`` is 1;
  pydantic refuses 7.5 for an int) neither is a multiple of 8.
- Stage-3 rows are parsed only: the rule is the config's, and DeepSpeed's stage-3 engine
  builds its CUDA quantizer op, which a CPU lacks (it would refuse for another reason).
- A refusal that needs an engine (fp32, ZenFlow) has a control row: the same config without
  quantized weights, which "the default path is unchanged" requires accepted. Where the
  subject was expected to accept the control and refused it, the refusal of the row shows
  nothing about the rule (ZenFlow may not build here at all): the row is ``unattributable``,
  and the control's own row fails.
- ZenFlow is configured as DeepSpeed 0.19.8 needs it to build (``runtime/zenflow``):
  ``zero_optimization.zenflow`` with ``offload_optimizer`` on the CPU (its optimizer refuses to
  run without offload) and a torch optimizer (SGD with ``zero_allow_untested_optimizer``):
  DeepSpeed's Adam would JIT-build its CPU Adam op, and ZenFlow's selective AdamW refuses the
  ``torch_adam`` key.

A subject that is not the PR states where it deliberately differs (``DIFFERENCES``), with the
reason the report prints: qwz's engine and its DeepSpeed drop-in support fp32 weights, and
qwz's engine implements neither ZenFlow nor offload.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from qwz.qualify.evidence.rules import rule
from qwz.qualify.evidence.schema import Check, Conformance, Record

NAME = "conformance"
ACCEPT, REFUSE, OPEN = "accept", "refuse", "open"
OUTCOMES = {ACCEPT: "accepted", REFUSE: "refused"}
"""Expected -> the observed outcome that meets it."""

PASS, FAIL = "pass", "fail"
OPEN_ROW = "open"
UNATTRIBUTABLE = "unattributable"
NOT_OBSERVED = "not observed"
OTHER_CONFIG = "other config"
UNKNOWN_ROW = "unknown row"
"""Per-row verdicts: ``pass``/``fail`` are judged; ``open`` (the PR leaves it open),
``unattributable`` (its control was refused too) and ``unknown row`` (not in today's table)
are context; ``not observed`` and ``other config`` (the record ran another config under the
row's name) leave the check inconclusive."""

CLAIMS = {
    "8513-default": "#8513: the group size key omitted means 64",
    "8513-multiple-of-8": "#8513: the group size is a positive multiple of 8",
    "8513-zero-3": "#8513: a non-default group size is rejected with ZeRO-3",
    "8511-fp32": "#8511: FP32 with quantized weights is rejected at optimizer initialization",
    "8511-zenflow": "#8511: ZenFlow with quantized weights is rejected at optimizer initialization",
    "8511-default-path": "#8511: the default ZeRO-1/2 path (no quantized weights) is unchanged",
}

QUANTIZED = "zero_quantized_weights"
GROUP_SIZE = "zero_quantized_weights_group_size"
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
"""torch's AdamW, as the qualification's arms use it: DeepSpeed's fused Adam JIT-builds an op."""
SGD = {"type": "SGD", "params": {"lr": 1e-3}}
OMITTED = object()


class Row(NamedTuple):
    name: str
    claim: str
    config: dict[str, Any]
    expected: str
    control: str | None = None
    """The row whose acceptance makes this row's refusal say something about the rule."""


def _config(stage: int, *, size: Any = OMITTED, quantized: bool = True, **kind: bool) -> dict:
    """A small DeepSpeed config: bf16 unless ``fp32``; ZenFlow as 0.19.8 builds it."""
    zero: dict[str, Any] = {"stage": stage}
    if quantized:
        zero[QUANTIZED] = True
    if size is not OMITTED:
        zero[GROUP_SIZE] = size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": ADAMW,
        "zero_optimization": zero,
    }
    if not kind.get("fp32"):
        config["bf16"] = {"enabled": True}
    if kind.get("zenflow"):
        zero |= {"zenflow": {}, "offload_optimizer": {"device": "cpu"}}
        config |= {"optimizer": SGD, "zero_allow_untested_optimizer": True}
    return copy.deepcopy(config)


def _engine_rows(kind: str, claim: str) -> list[Row]:
    """``kind`` (fp32, zenflow) with quantized weights refused, and its control accepted."""
    rows = []
    for stage in (1, 2):
        control = f"stage{stage}-{kind}-unquantized"
        unquantized = _config(stage, quantized=False, **{kind: True})
        rows += [
            Row(f"stage{stage}-{kind}", claim, _config(stage, **{kind: True}), REFUSE, control),
            Row(control, "8511-default-path", unquantized, ACCEPT),
        ]
    return rows


ROWS: tuple[Row, ...] = (
    *(Row(f"stage{stage}-omitted", "8513-default", _config(stage), ACCEPT) for stage in (1, 2)),
    *(
        Row(f"stage{stage}-g{size}", "8513-multiple-of-8", _config(stage, size=size), ACCEPT)
        for size in (8, 64, 8192)
        for stage in (1, 2)
    ),
    *(
        Row(f"stage2-g{label}", "8513-multiple-of-8", _config(2, size=size), REFUSE)
        for label, size in (("0", 0), ("-8", -8), ("12", 12), ("7.5", 7.5), ("true", True))
    ),
    Row("stage2-g64-string", "8513-multiple-of-8", _config(2, size="64"), OPEN),
    Row("stage3-g64", "8513-zero-3", _config(3, size=64), ACCEPT),
    Row("stage3-g128", "8513-zero-3", _config(3, size=128), REFUSE),
    *_engine_rows("fp32", "8511-fp32"),
    *_engine_rows("zenflow", "8511-zenflow"),
)
TABLE = {row.name: row for row in ROWS}

OPEN_REASONS = {
    "stage2-g64-string": "the PR does not say whether a numeric string is coerced: DeepSpeed's "
    'lax pydantic config takes "64" as 64 (0.19.8 takes reduce_bucket_size "500" as 500), a '
    "strict parser refuses it; either is correct",
}


class Difference(NamedTuple):
    """Where a subject that is not the PR deliberately expects another outcome, and why."""

    expected: str
    reason: str


_QWZ_FP32 = (
    "qwz supports fp32 weights: its gather quantizes an fp32 working copy as it does a bf16 "
    "one (1 + 4/G bytes per element against 4), so it accepts what the PR rejects"
)
_QWZ_ZENFLOW = (
    "qwz's engine implements neither ZenFlow nor optimizer offload, which ZenFlow needs: it "
    "refuses ZenFlow with or without quantized weights"
)
DIFFERENCES: dict[str, dict[str, Difference]] = {
    "qwz": {
        **{f"stage{stage}-fp32": Difference(ACCEPT, _QWZ_FP32) for stage in (1, 2)},
        **{f"stage{s}-zenflow-unquantized": Difference(REFUSE, _QWZ_ZENFLOW) for s in (1, 2)},
    },
    "deepspeed": {
        f"stage{stage}-fp32": Difference(ACCEPT, f"{_QWZ_FP32} (the DeepSpeed drop-in)")
        for stage in (1, 2)
    },
}
"""Subject -> row -> its deliberate difference from the PR (subjects: qualify/base/plan.py)."""

NORMATIVE = {
    "rows": {row.name: [row.claim, row.config, row.expected, row.control] for row in ROWS},
    "differences": {
        subject: {name: difference.expected for name, difference in rows.items()}
        for subject, rows in DIFFERENCES.items()
    },
}
"""What the rule decides by (judge.py seals its digest): the reasons are presentation."""


def expected_outcomes(subject: str) -> dict[str, tuple[str, str | None]]:
    """Row -> (expected outcome, the reason where it is open or the subject differs)."""
    differences = DIFFERENCES.get(subject, {})
    expected: dict[str, tuple[str, str | None]] = {}
    for row in ROWS:
        if row.name in differences:
            expected[row.name] = differences[row.name]
        else:
            expected[row.name] = (row.expected, OPEN_REASONS.get(row.name))
    return expected


class JudgedRow(NamedTuple):
    row: str
    claim: str | None
    expected: str | None
    """accept, refuse or open; None: a row today's table does not have."""
    observed: str | None
    """accepted or refused; None: not observed."""
    verdict: str
    reason: str | None = None


def _verdict(row: Row, observed: dict[str, Any], expected: dict[str, tuple[str, str | None]]):
    """One known row's verdict ([Note: the PR's config rules]); ``observed``: name -> its
    ConformanceRow in the record."""
    seen = observed.get(row.name)
    if seen is None:
        return NOT_OBSERVED
    if seen.config != row.config:
        return OTHER_CONFIG
    wanted = expected[row.name][0]
    if wanted == OPEN:
        return OPEN_ROW
    if OUTCOMES[wanted] != seen.observed:
        return FAIL
    control = observed.get(row.control) if row.control else None
    if wanted == REFUSE and control is not None and control.observed == "refused":
        # The control was refused too: where the subject should accept it, this refusal
        # shows nothing about the rule (and the control's own row fails).
        return UNATTRIBUTABLE if expected[control.row][0] == ACCEPT else PASS
    return PASS


def judged_rows(section: Conformance, subject: str) -> list[JudgedRow]:
    """Every row of today's table judged against the record's observations, then the rows the
    record has that today's table does not (context)."""
    observed = {item.row: item for item in section.rows}
    expected = expected_outcomes(subject)
    rows = [
        JudgedRow(
            row.name,
            row.claim,
            expected[row.name][0],
            observed[row.name].observed if row.name in observed else None,
            _verdict(row, observed, expected),
            expected[row.name][1],
        )
        for row in ROWS
    ]
    rows += [
        JudgedRow(item.row, None, None, item.observed, UNKNOWN_ROW)
        for item in section.rows
        if item.row not in TABLE
    ]
    return rows


def _row_numbers(row: JudgedRow) -> dict[str, Any]:
    return {
        "row": row.row,
        "claim": row.claim,
        "expected": row.expected,
        "observed": row.observed,
        "verdict": row.verdict,
    }


@rule(NAME, 1, inputs=(NAME,))
def conformance(record: Record) -> Check:
    """``conformance``: FAIL where the subject's parser or engine took a judged row otherwise
    than the PR's text (or the subject's stated difference) says; inconclusive where the
    harness could not run the table or a judged row is missing ([Note: the PR's config
    rules])."""
    section = record.conformance
    if section is None:
        return Check(
            name=NAME,
            status="n/a",
            detail="not observed: the run did not put the PR's config rules to the subject",
            numbers={"not_observed": [NAME]},
        )
    if section.error is not None:
        return Check(
            name=NAME,
            status="inconclusive",
            detail=f"the harness could not run the config rules: {section.error}",
            numbers={"error": section.error},
        )
    rows = judged_rows(section, record.subject.name)
    failed = [row for row in rows if row.verdict == FAIL]
    missing = [row.row for row in rows if row.verdict in (NOT_OBSERVED, OTHER_CONFIG)]
    judged = sum(row.verdict in (PASS, FAIL) for row in rows)
    numbers = {
        "rows": [_row_numbers(row) for row in rows],
        "failed": [row.row for row in failed],
        "judged": judged,
    }
    context = len(rows) - judged - len(missing)
    if failed:
        named = ", ".join(f"{row.row} (expected {row.expected}, {row.observed})" for row in failed)
        return Check(
            name=NAME,
            status="fail",
            detail=f"{len(failed)} of {judged} rows differ from the PR's config rules: {named}",
            numbers=numbers,
        )
    if missing:
        return Check(
            name=NAME,
            status="inconclusive",
            detail=f"rows of the table not observed as stated: {', '.join(missing)}",
            numbers=numbers,
        )
    return Check(
        name=NAME,
        status="pass",
        detail=f"all {judged} judged rows as the PR states ({context} context rows: open, "
        "unattributable or unknown to this judge)",
        numbers=numbers,
    )
