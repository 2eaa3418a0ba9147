"""The report's section on the PR's config rules: every row of the conformance table, with
what the subject's own parser and engine did and said, read from the record; the expected
outcomes and verdicts are today's judge's ([Note: the PR's config rules],
qualify/evidence/rules/conformance.py)."""

from __future__ import annotations

import json
from typing import Any

from qwz.qualify.evidence.rules import conformance
from qwz.qualify.evidence.schema import Record
from qwz.qualify.review.formatting import table

_VERDICTS = {
    conformance.PASS: "PASS",
    conformance.FAIL: "**FAIL**",
    conformance.OPEN_ROW: "context: open",
    conformance.UNATTRIBUTABLE: "context: its control was refused too",
    conformance.UNKNOWN_ROW: "context: not in this judge's table",
    conformance.NOT_OBSERVED: "*not observed*",
    conformance.OTHER_CONFIG: "*another config*",
}


def config_text(config: dict[str, Any]) -> str:
    """The keys a row is about: ``stage 2, quantized, G=12``, ``fp32``, ``ZenFlow``."""
    zero = config.get("zero_optimization") or {}
    parts = [f"stage {zero.get('stage')}"]
    if zero.get(conformance.QUANTIZED):
        parts.append("quantized")
    if conformance.GROUP_SIZE in zero:
        parts.append(f"G={json.dumps(zero[conformance.GROUP_SIZE])}")
    precision = [key for key in ("bf16", "fp16") if (config.get(key) or {}).get("enabled")]
    parts.append(precision[0] if precision else "fp32")
    if "zenflow" in zero:
        parts.append("ZenFlow (CPU offload, SGD)")
    return ", ".join(parts)


def _observed(row) -> str:
    if row.observed == "refused":
        return f"refused ({row.refused_at})"
    size = f", G {row.group_size}" if row.group_size is not None else ""
    return f"accepted ({' + '.join(row.ran)}{size})"


def conformance_section(record: Record) -> list[str]:
    section = record.conformance
    lines = ["## The PR's config rules (conformance)", ""]
    if section is None:
        said = "Not observed: the run did not put the PR's config rules to the subject."
        return [*lines, said, ""]
    if section.error is not None:
        return [*lines, f"The harness could not run the table (no verdict): {section.error}", ""]
    lines += [
        f"Every config went to the subject's parser, {section.parser}, and where it accepted a "
        f"stage-1 or stage-2 config, to its engine, {section.engine}, for a tiny model at one "
        f"rank on the CPU ({len(section.rows)} configs, {section.seconds:.1f} s). Expected "
        "outcomes are the judge's, from the PR's text; an open row is context, never a verdict.",
        "",
    ]
    observed = {row.row: row for row in section.rows}
    judged = conformance.judged_rows(section, record.subject.name)
    lines += table(
        ["row", "config", "claim", "expected", "observed", "the subject's message", "verdict"],
        [
            (
                f"`{row.row}`",
                config_text(observed[row.row].config) if row.row in observed else "—",
                row.claim or "—",
                row.expected or "—",
                _observed(observed[row.row]) if row.row in observed else "—",
                (observed[row.row].message if row.row in observed else None) or "—",
                _VERDICTS[row.verdict],
            )
            for row in judged
        ],
    )
    lines += [f"- `{key}`: {text}" for key, text in conformance.CLAIMS.items()]
    return [*lines, *_reasons(record.subject.name, judged), ""]


def _reasons(subject: str, judged: list[conformance.JudgedRow]) -> list[str]:
    """Why a row is open, and where the subject deliberately differs from the PR."""
    differences = conformance.DIFFERENCES.get(subject, {})
    lines = []
    for row in judged:
        if row.row in differences:
            pr = conformance.TABLE[row.row].expected
            lines.append(
                f"- `{row.row}`: {subject} expects {row.expected}, where the PR says {pr}: "
                f"{row.reason}"
            )
        elif row.reason:
            lines.append(f"- `{row.row}` is open: {row.reason}")
    return lines
