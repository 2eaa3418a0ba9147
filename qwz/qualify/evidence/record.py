"""Records on disk: ``save`` writes one atomically (signed when asked), ``load`` reads one and
trusts it only if everything derived in it follows from its observations.

Loading checks the schema version (a newer one is refused by its number), recomputes the digest
on the payload as written (an accidental edit is an error), upgrades an older schema in memory
([Note: schema versions], upgrade.py), validates the schema (unknown or missing fields, wrong
types, a truncated file are errors), and judges the record again by today's rules ([Note:
rejudging], rejudge.py): a stored check of an unchanged rule that does not follow from the data
makes the record invalid, however it was sealed; a check of another rule version is kept as
judged, with today's beside it. Every failure is a :class:`RecordError` naming the file and the
cause. This module sits above the schema, the seal and the checks, so none of them imports it.
"""

from __future__ import annotations

import json
import pathlib

from pydantic import ValidationError

from qwz import jsonio
from qwz.qualify.base.files import atomic_write_text
from qwz.qualify.evidence.rejudge import absent_inputs, rejudge
from qwz.qualify.evidence.run_dir import record_in
from qwz.qualify.evidence.schema import Record, RecordError
from qwz.qualify.evidence.seal import canonical_digest, verdict_of
from qwz.qualify.evidence.signing import SigningKey, SigningKeyError, configured_key, sign, verifies
from qwz.qualify.evidence.upgrade import upgrade, version_problem


def save(record: Record, path: pathlib.Path, *, key: SigningKey | None = None) -> None:
    """Write ``record`` atomically; signed with ``key`` when given ([Note: digest and
    signature] in qwz/qualify/evidence/signing.py), else with the signature it already carries.

    A record load upgraded from an older schema is never written back (its digest and
    signature are of the bytes as written): copy its file instead."""
    if record.upgraded_from is not None:
        raise RecordError(
            f"{path}: this record was written in schema {record.upgraded_from} and upgraded in "
            "memory; it is never rewritten (copy its file)"
        )
    payload = record.model_dump(mode="json")
    signature = sign(record.digest, key) if key is not None else record.signature
    if signature is not None:
        payload["signature"] = signature.model_dump()
    atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def load(path: str | pathlib.Path) -> Record:
    """Read and verify a record; any problem is a RecordError of one line naming the file.

    `path` is the record's file or its run directory (run_dir.record_in: a directory whose
    run left no record is refused naming the file that says why). The file is read by
    ``qwz.jsonio`` ([Note: bounded JSON]: regular files only, size, depth, integer and list
    bounds, no NaN/Infinity, no duplicate keys) and validated in pydantic's strict mode:
    ``"2"`` is not an int, ``"false"`` not a bool."""
    path = record_in(pathlib.Path(path))
    try:
        payload = jsonio.read_json_file(path, what="record")
    except jsonio.JsonInputError as error:
        raise RecordError(str(error)) from None
    if not isinstance(payload, dict):
        raise RecordError(f"{path}: a record is a JSON object, not {type(payload).__name__}")
    problem = version_problem(payload.get("schema_version"))
    if problem:
        raise RecordError(f"{path}: {problem}")
    stored_digest = payload.get("digest")
    expected = canonical_digest(
        {key: value for key, value in payload.items() if key != "signature"}
    )
    if not isinstance(stored_digest, str) or stored_digest != expected:
        shown = stored_digest[:16] if isinstance(stored_digest, str) else repr(stored_digest)
        raise RecordError(
            f"{path}: digest mismatch: the record was edited after it was written "
            f"(stored {shown}..., content {expected[:16]}...)"
        )
    absent = absent_inputs(payload)
    payload, upgraded_from = upgrade(payload)
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
    if upgraded_from is not None:
        record = record.model_copy(update={"upgraded_from": upgraded_from})
    if record.verdict != verdict_of(record.checks):
        raise RecordError(f"{path}: the verdict does not follow from the checks")
    record._absent = absent
    record._rejudged = (id(record), rejudge(record, absent, f"{path}: "))
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
