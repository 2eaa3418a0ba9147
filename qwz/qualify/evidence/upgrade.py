"""Reading records of older schemas: in-memory upgraders, one per version step.

[Note: schema versions]
The schema's version is written once, ``schema.SCHEMA_VERSION``. A record of an older version is
read by upgrading its payload in memory, step by step, *after* its digest (and, by the loader,
its signature) has been verified on the bytes as written: a file is never rewritten, a signed
one least of all (record.save refuses an upgraded record; promote copies the file). Every field
a version adds has a default that means what an older record meant, so most steps only name
the version. A record newer than this qwz is refused by its version, before any field is
judged: "written by schema N; this qwz reads up to M".

2 -> 3: the judge's identity (``judge``, null: unknown) and each check's rule version
(``Check.rule`` 0: judged before rules were versioned) are new; records of schema 2 also
gained fields during schema 2 (every one optional, with its old meaning as default).

3 -> 4: every run setting has one name for its flag, its plan field and its record key (the
plan's renamed keys, ``_plan_from_3``; each arm's ``integration_enabled`` is ``qwz_gather``);
the fused kernels are called by what they are: ``"compiled"`` (the native C kernels on
CPU, torch.compile elsewhere, never only torch.compile) becomes ``"fused"`` in each arm's
``kernels`` and in each rank's kernel use (``own_shards[].kernels[].kernels``).

4 -> 5: new, each with a default that says an older record lacks it: the table of the PR's
config rules run through the subject's parser and engine (``conformance``; "not observed" in
an older record, rules.INPUTS), every arm's short master digests after every step
(``step_masters``; what compares them, the review of a pull request in
qualify/evidence/default_path.py, says it could not), the user's DeepSpeed config file
(``plan.ds_config``, null: none) and the class of the optimizer that stepped the masters
(``updates[].optimizer``, null: not named; ``update`` then re-derives AdamW from the plan);
each arm's ``allgather_bucket_size`` (the chunked arm's is its own: [Note: the chunked arm],
qualify/run/chunked_arm.py; an older arm's is the one its config gave its engine,
``_bucket_from_4``) and each wire entry's ``largest_output_bytes`` (absent: ``bounded``
reads "not observed", rules.py ``inputs``).

5 -> 6: the contract names its schemes ([Note: one scheme per run], contract.py): each arm's
own-shard section gains the scheme each rank identified (``scheme_by_rank``; empty: judged when
absmax/127 was the only scheme), the elements per scheme, the ZeRO++ freedoms and overflows
(0 in an older record, which had no such scheme), and what the scheme cost (``cost``, null:
not measured); the subject gains the ops the harness substituted (``substituted_ops``, empty:
none, as every older run had none); a drift step whose sampled weight was not finite is null
(before, such a run wrote no record at all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qwz.qualify.evidence.schema import OLDEST_SCHEMA_VERSION, SCHEMA_VERSION, RecordError


def _from_2(payload: dict[str, Any]) -> dict[str, Any]:
    checks = payload.get("checks")
    if isinstance(checks, list):
        payload["checks"] = [
            dict(check, rule=0) if isinstance(check, dict) and "rule" not in check else check
            for check in checks
        ]
    return dict(payload, schema_version=3)


PLAN_RENAMED_IN_4 = {
    "integration_enabled": "qwz_gather",
    "calibrate": "calibration",
    "one_arm_resident": "one_arm_at_a_time",
}
"""Plan keys of schema 3 -> their names since, when each run setting got one name for its
flag, its field and its record key ([Note: one declaration per setting], qualify/base/values.py)."""


def _plan_from_3(plan: dict[str, Any]) -> dict[str, Any]:
    """A schema-3 plan in schema 4's names: the renamed keys, ``compile_kernels`` as
    ``kernels``, and ``reduce_bucket_size``, which ``--bucket-size`` set equal to
    ``allgather_bucket_size``."""
    upgraded = {PLAN_RENAMED_IN_4.get(key, key): value for key, value in plan.items()}
    if "compile_kernels" in upgraded:
        upgraded["kernels"] = "fused" if upgraded.pop("compile_kernels") else "eager"
    if "allgather_bucket_size" in upgraded:
        upgraded.setdefault("reduce_bucket_size", upgraded["allgather_bucket_size"])
    return upgraded


def _fused(value: Any) -> Any:
    return "fused" if value == "compiled" else value


def _renamed_kernels(entry: Any) -> Any:
    """`entry` (an arm or a kernel use) with ``kernels`` "compiled" renamed "fused", and an
    arm's ``integration_enabled`` renamed ``qwz_gather``."""
    if not isinstance(entry, dict):
        return entry
    entry = {"qwz_gather" if key == "integration_enabled" else key: v for key, v in entry.items()}
    if "kernels" in entry:
        entry["kernels"] = _fused(entry["kernels"])
    return entry


def _from_3(payload: dict[str, Any]) -> dict[str, Any]:
    upgraded = dict(payload, schema_version=4)
    plan = payload.get("plan")
    if isinstance(plan, dict):
        upgraded["plan"] = _plan_from_3(plan)
    arms = payload.get("arms")
    if isinstance(arms, list):
        upgraded["arms"] = [_renamed_kernels(arm) for arm in arms]
    own_shards = payload.get("own_shards")
    if isinstance(own_shards, list):
        upgraded["own_shards"] = [
            dict(own, kernels=[_renamed_kernels(use) for use in own["kernels"]])
            if isinstance(own, dict) and isinstance(own.get("kernels"), list)
            else own
            for own in own_shards
        ]
    return upgraded


def _bucket_from_4(arm: Any) -> Any:
    """A schema-4 arm with the ``allgather_bucket_size`` its config gave its engine."""
    if not isinstance(arm, dict) or "allgather_bucket_size" in arm:
        return arm
    config = arm.get("config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    bucket = zero.get("allgather_bucket_size") if isinstance(zero, dict) else None
    if isinstance(bucket, float) and bucket.is_integer():  # DeepSpeed configs write 5e8
        bucket = int(bucket)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        bucket = None
    return dict(arm, allgather_bucket_size=bucket)


def _from_4(payload: dict[str, Any]) -> dict[str, Any]:
    upgraded = dict(payload, schema_version=5)
    arms = payload.get("arms")
    if isinstance(arms, list):
        upgraded["arms"] = [_bucket_from_4(arm) for arm in arms]
    return upgraded


def _from_5(payload: dict[str, Any]) -> dict[str, Any]:
    return dict(payload, schema_version=6)


UPGRADERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    2: _from_2,
    3: _from_3,
    4: _from_4,
    5: _from_5,
}
"""Version N -> the step from N to N + 1."""


def version_problem(version: Any) -> str | None:
    """Why a record of ``version`` cannot be read, or None."""
    if type(version) is not int:
        return f"schema_version {version!r} is not an integer"
    if version > SCHEMA_VERSION:
        return (
            f"written by schema {version}; this qwz reads up to {SCHEMA_VERSION} "
            "(upgrade qwz to read it)"
        )
    if version < OLDEST_SCHEMA_VERSION:
        return (
            f"schema_version {version} is not supported (this qwz reads schemas "
            f"{OLDEST_SCHEMA_VERSION} to {SCHEMA_VERSION})"
        )
    return None


def upgrade(payload: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """``payload`` at ``SCHEMA_VERSION`` and the version it was written in (None: current)."""
    version = payload.get("schema_version")
    problem = version_problem(version)
    if problem:
        raise RecordError(problem)
    if version == SCHEMA_VERSION:
        return payload, None
    upgraded = dict(payload)
    for step in range(version, SCHEMA_VERSION):
        upgraded = UPGRADERS[step](upgraded)
    return upgraded, version
