"""Sealing: a payload of raw observations becomes a record with its derived checks, verdict
and digest (the digest and the verdict rule are defined here; the checks in checks.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from qwz.qualify.evidence import judge
from qwz.qualify.evidence.checks import derive
from qwz.qualify.evidence.rules.speed import summarize_blocks
from qwz.qualify.evidence.schema import Check, Record, RecordError, Verdict


def canonical_digest(payload: dict[str, Any]) -> str:
    body = {key: value for key, value in payload.items() if key != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def verdict_of(checks: list[Check]) -> Verdict:
    """FAIL if any check failed; else INCONCLUSIVE if any was inconclusive (the reference did
    not learn, so learning could not be judged; or one rank, where nothing was quantized or
    sent: [Note: one rank], qualify/evidence/rules/in_effect.py); else PASS."""
    failed = [check.name for check in checks if check.status == "fail"]
    inconclusive = [check.name for check in checks if check.status == "inconclusive"]
    status = "FAIL" if failed else "INCONCLUSIVE" if inconclusive else "PASS"
    return Verdict(
        status=status,
        passed=status == "PASS",
        failed=failed,
        inconclusive=inconclusive,
        evidence=[check.name for check in checks if check.evidence],
        not_applicable=[
            f"{check.name}: {check.detail}" for check in checks if check.status == "n/a"
        ],
    )


_PLACEHOLDER_VERDICT = {
    "status": "FAIL",
    "passed": False,
    "failed": [],
    "inconclusive": [],
    "evidence": [],
    "not_applicable": [],
}


def seal(payload: dict[str, Any]) -> Record:
    """Validate a record payload of raw observations (any ``checks``, ``verdict``,
    ``digest``, ``judge`` and speed summaries in it are ignored), derive its speed summaries,
    checks and verdict (qualify/evidence/checks.py), name today's judge ([Note: judge
    identity], judge.py), and return it with its digest set.

    The digest is computed over the validated model's JSON, exactly what `save` writes,
    so normalisation by pydantic (an int given for a float, a default filled in) cannot
    make a freshly sealed record fail `load`."""
    payload = dict(
        payload,
        checks=[],
        verdict=_PLACEHOLDER_VERDICT,
        digest="",
        judge=judge.current().model_dump(mode="json"),
    )
    if isinstance(payload.get("performance"), list):
        payload["performance"] = [
            dict(item, **summarize_blocks(item["blocks"]))
            if isinstance(item, dict) and isinstance(item.get("blocks"), list)
            else item
            for item in payload["performance"]
        ]
    try:
        record = Record.model_validate(payload)
    except (ValidationError, KeyError, TypeError) as error:
        raise RecordError(f"record payload is invalid: {error}") from None
    checks = derive(record)
    record = record.model_copy(update={"checks": checks, "verdict": verdict_of(checks)})
    # Round trip through JSON so that the digest covers exactly what `save` writes.
    record = Record.model_validate(record.model_dump(mode="json"))
    digest = canonical_digest(record.model_dump(mode="json"))
    return record.model_copy(update={"digest": digest})
