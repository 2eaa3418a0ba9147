"""The evidence record: a pydantic model, its digest, and loading that never silently passes.

A record is written once by ``qwz-qualify run`` and read by ``report`` and
``compare``. It is bound to the code under test by ``head`` (repository, SHA,
dirty flag) and to itself by ``digest``: the sha256 of its canonical JSON
without the digest. Loading validates the schema (unknown or missing fields,
wrong types, a truncated file are errors), recomputes the digest (an edited
record is an error), and checks that the verdict is the conjunction of the
checks. Every failure is a :class:`RecordError` naming the file and the cause.

``python -m qwz.qualify.record`` regenerates ``record.schema.json`` (the
published JSON Schema) from the models.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qwz import jsonio
from qwz.qualify.files import atomic_write_text
from qwz.qualify.signing import (
    Signature,
    SigningKey,
    SigningKeyError,
    configured_key,
    sign,
    verifies,
)

SCHEMA_VERSION = 1
SCHEMA_PATH = pathlib.Path(__file__).with_name("record.schema.json")


class RecordError(ValueError):
    """A record could not be trusted: unreadable, invalid, edited, or inconsistent."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Head(_Model):
    """The code under test."""

    repository: str
    sha: str = Field(description="Full git SHA of HEAD, or 'unknown' outside a git checkout")
    dirty: bool = Field(description="Uncommitted changes to tracked files")


class Subject(_Model):
    """Which implementation ran the arms."""

    name: Literal["qwz", "deepspeed"]
    version: str
    sha: str | None = Field(None, description="Git SHA when installed from a checkout")


class Environment(_Model):
    python: str
    torch: str
    deepspeed: str | None
    transformers: str | None
    backend: str
    device_names: list[str]
    world_size: int
    node_count: int
    platform: str

    def fingerprint(self) -> str:
        """What must match for hashes to be reproducible: versions, backend, devices, ranks."""
        payload = self.model_dump(exclude={"platform"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class Workload(_Model):
    name: str
    params: dict[str, Any]
    num_parameters: int
    steps: int
    seed: int


class Arm(_Model):
    """One configuration that was trained: the reference or a candidate."""

    name: str
    quantized: bool
    group_size: int | None
    stage: int
    dtype: str
    kernels: Literal["eager", "compiled"] = Field(
        description="Quantize/dequantize kernels: eager, or fused by torch.compile"
    )
    integration_enabled: bool = Field(
        description="deepspeed subject: whether qwz's gather was allowed to take over"
    )
    config: dict[str, Any] = Field(description="The DeepSpeed-style config given to the engine")


class Trajectory(_Model):
    arm: str
    losses: list[float | None] = Field(
        description="Loss per step, averaged over ranks; null where it was NaN or infinite"
    )
    grad_norms: list[float | None] = Field(
        description="Global gradient norm per step; null where it was NaN or infinite"
    )


class Tolerance(_Model):
    arm: str
    bound: str
    samples_per_step: int
    steps: int
    checked: int
    violations: int
    max_ratio: float = Field(description="Largest |candidate - reference| / bound seen")
    max_abs_error: float
    own_shard_max_ratio: float | None = Field(
        description="Worst error / allowed error of every rank's own shard against its fp32 "
        "master after every step (qwz.tolerance.own_shard_decode_ratio); <= 1 when the "
        "gather is right; null where infinite (an exact element was not exact)"
    )


class Hashes(_Model):
    arm: str
    per_rank: list[str]
    ledger_status: Literal["reproduced", "recorded", "mismatch", "not-checked"]
    ledger_previous: str | None = None


class Probe(_Model):
    arm: str
    requested_group_size: int | None
    reported_group_sizes: list[int | None]
    gather_bytes_per_step: int = Field(description="Bytes rank 0 sent in the weight gather")
    reference_gather_bytes_per_step: int


class Block(_Model):
    index: int
    order: Literal["AB", "BA"]
    reference_step_s: float = Field(description="Median step time of the reference in the block")
    candidate_step_s: float
    speedup: float = Field(description="reference_step_s / candidate_step_s")


class Memory(_Model):
    rank: int
    kind: Literal["cuda", "rss"]
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None


class Performance(_Model):
    arm: str
    block_steps: int
    warmup_steps: int
    blocks: list[Block]
    median_speedup: float
    ci_low: float
    ci_high: float
    ci_method: str
    p_value: float
    test: str
    memory: list[Memory]


class Check(_Model):
    name: str
    passed: bool
    detail: str
    numbers: dict[str, Any] = Field(default_factory=dict)


class Verdict(_Model):
    passed: bool
    failed: list[str]


class Record(_Model):
    schema_version: Literal[1] = SCHEMA_VERSION
    created_at: str
    head: Head
    subject: Subject
    environment: Environment
    workload: Workload
    arms: list[Arm]
    trajectories: list[Trajectory]
    tolerance: list[Tolerance]
    hashes: list[Hashes]
    probes: list[Probe]
    performance: list[Performance]
    checks: list[Check]
    verdict: Verdict
    digest: str = Field(description="sha256 of the canonical JSON of the record without digest")
    signature: Signature | None = Field(
        None, exclude=True, description="Keyed signature of the digest; outside the digest"
    )


def canonical_digest(payload: dict[str, Any]) -> str:
    body = {key: value for key, value in payload.items() if key != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def verdict_of(checks: list[Check]) -> Verdict:
    failed = [check.name for check in checks if not check.passed]
    return Verdict(passed=not failed, failed=failed)


def seal(payload: dict[str, Any]) -> Record:
    """Validate a record payload (without digest) and return it with its digest set.

    The digest is computed over the validated model's JSON, exactly what `save` writes,
    so normalisation by pydantic (an int given for a float, a default filled in) cannot
    make a freshly sealed record fail `load`."""
    try:
        record = Record.model_validate(dict(payload, digest=""))
    except ValidationError as error:
        raise RecordError(f"record payload is invalid: {error}") from None
    digest = canonical_digest(record.model_dump(mode="json"))
    return record.model_copy(update={"digest": digest})


def save(record: Record, path: pathlib.Path, *, key: SigningKey | None = None) -> None:
    """Write ``record`` atomically; signed with ``key`` when given ([Note: digest and
    signature] in qwz/qualify/signing.py), else with the signature it already carries."""
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
    if record.verdict != verdict_of(record.checks):
        raise RecordError(f"{path}: the verdict does not follow from the checks")
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


def json_schema() -> dict[str, Any]:
    return Record.model_json_schema()


if __name__ == "__main__":
    SCHEMA_PATH.write_text(json.dumps(json_schema(), indent=2) + "\n")
    print(f"wrote {SCHEMA_PATH}")
