"""Records on disk: ``save`` writes one atomically (signed when asked), ``load`` reads one and
trusts it only if everything derived in it follows from its observations.

Loading validates the schema (unknown or missing fields, wrong types, a truncated file are
errors), recomputes the digest (an accidental edit is an error), and derives the checks, the
verdict and the speed summaries again from the observations (checks.py): a record whose
stored conclusions do not follow from its data is invalid, however it was sealed. Every
failure is a :class:`RecordError` naming the file and the cause. This module sits above the
schema, the seal and the checks, so none of them imports it.
"""

from __future__ import annotations

import json
import pathlib

from pydantic import ValidationError

from qwz import jsonio
from qwz.qualify.evidence.checks import derive, summarize_blocks
from qwz.qualify.evidence.schema import SCHEMA_VERSION, Check, Record, RecordError
from qwz.qualify.evidence.seal import canonical_digest, verdict_of
from qwz.qualify.evidence.signing import SigningKey, SigningKeyError, configured_key, sign, verifies
from qwz.qualify.files import atomic_write_text


def _rederive(path: pathlib.Path, record: Record) -> None:
    """Raise unless every derived field follows from the raw observations."""
    for performance in record.performance:
        raw = [block.model_dump(mode="json") for block in performance.blocks]
        expected = summarize_blocks(raw)
        stored = performance.model_dump(mode="json")
        wrong = [key for key, value in expected.items() if stored[key] != value]
        if wrong:
            raise RecordError(
                f"{path}: performance of {performance.arm!r}: {', '.join(wrong)} do not follow "
                "from the recorded step times"
            )
    checks = derive(record)
    stored_checks = [check.model_dump(mode="json") for check in record.checks]
    derived_checks = [
        Check.model_validate(check.model_dump(mode="json")).model_dump(mode="json")
        for check in checks
    ]
    if stored_checks != derived_checks:
        names = {check["name"] for check in stored_checks} ^ {c["name"] for c in derived_checks}
        differing = [
            stored["name"]
            for stored, ours in zip(stored_checks, derived_checks, strict=False)
            if stored != ours
        ]
        raise RecordError(
            f"{path}: the stored checks do not follow from the recorded observations "
            f"(differ: {', '.join(sorted(set(differing) | names)) or 'order'})"
        )
    if record.verdict != verdict_of(record.checks):
        raise RecordError(f"{path}: the verdict does not follow from the checks")


def save(record: Record, path: pathlib.Path, *, key: SigningKey | None = None) -> None:
    """Write ``record`` atomically; signed with ``key`` when given ([Note: digest and
    signature] in qwz/qualify/evidence/signing.py), else with the signature it already carries."""
    payload = record.model_dump(mode="json")
    signature = sign(record.digest, key) if key is not None else record.signature
    if signature is not None:
        payload["signature"] = signature.model_dump()
    atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def load(path: str | pathlib.Path) -> Record:
    """Read and verify a record; any problem is a RecordError of one line naming the file.

    The file is read by ``qwz.jsonio`` ([Note: bounded JSON]: regular files only, size,
    depth, integer and list bounds, no NaN/Infinity, no duplicate keys) and validated in
    pydantic's strict mode: ``"2"`` is not an int, ``"false"`` not a bool."""
    path = pathlib.Path(path)
    try:
        payload = jsonio.read_json_file(path, what="record")
    except jsonio.JsonInputError as error:
        raise RecordError(str(error)) from None
    if not isinstance(payload, dict):
        raise RecordError(f"{path}: a record is a JSON object, not {type(payload).__name__}")
    version = payload.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise RecordError(
            f"{path}: schema_version {jsonio.bounded_repr(version, 60)} is not supported "
            f"(this qwz reads the integer {SCHEMA_VERSION})"
        )
    try:
        record = Record.model_validate(payload, strict=True)
    except ValidationError as error:
        problems = [
            f"{'.'.join(map(str, problem['loc'])) or '(record)'}: {problem['msg']} "
            f"(got {jsonio.bounded_repr(problem.get('input'), 60)})"
            for problem in error.errors(include_url=False)
        ]
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise RecordError(
            f"{path}: does not match the record schema: {'; '.join(problems[:3])}{more}"
        ) from None
    expected = canonical_digest(
        {key: value for key, value in payload.items() if key != "signature"}
    )
    if record.digest != expected:
        raise RecordError(
            f"{path}: digest mismatch: the record was edited after it was written "
            f"(stored {record.digest[:16]}..., content {expected[:16]}...)"
        )
    _rederive(path, record)
    if record.signature is not None:
        try:
            key = configured_key()
        except SigningKeyError as error:
            raise RecordError(f"{path}: cannot verify the signature: {error}") from None
        ours = key is not None and record.signature.key_id == key.key_id
        if ours and not verifies(record.digest, record.signature, key):
            raise RecordError(
                f"{path}: the signature of key id {key.key_id} does not verify: "
                "the record was changed after it was signed"
            )
    return record
