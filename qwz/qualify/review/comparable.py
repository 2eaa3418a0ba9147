"""Whether two records can be compared at all (``compare``'s status 2, its refusal): what must
be the same on both sides for a difference to be the code's.

Not comparable:
  - schema major versions differ (older records are upgraded in memory on load, so this is
    only a record newer than this qwz, which load refuses);
  - environment fingerprints differ (python, torch, deepspeed, transformers,
    backend, devices, world size, nodes: what hashes depend on; a field one side's
    schema did not record yet, such as ``cuda``, is left out of both) -- for two
    ``deepspeed-native`` records the DeepSpeed version is the subject's, not the
    environment's, so ``compare BASE HEAD`` of two DeepSpeed commits (even two
    versions) is allowed and reports the change; other machine differences (CPU model,
    memory, host names) are notes;
  - the subject differs (qwz against DeepSpeed, DeepSpeed's own code against
    DeepSpeed with qwz's gather);
  - the workload differs (name, params, steps, seed) or the arms differ (names,
    order, quantization, group size, stage, dtype, config) -- but for a chunked arm
    ([Note: the chunked arm], qualify/run/chunked_arm.py) on one side only: a harness that
    adds it judges more of the same setup, and its checks are new checks (below).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qwz.qualify.base.plan import CHUNKED_SUFFIX
from qwz.qualify.evidence.schema import MACHINE_FIELDS, Record


def differences(before: Any, after: Any, path: str) -> list[str]:
    """``path: before -> after`` for every leaf that differs, dicts compared key by key."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        lines = []
        for key in sorted(set(before) | set(after), key=str):
            if key not in after:
                lines.append(f"{path}.{key}: {before[key]!r} -> (absent)")
            elif key not in before:
                lines.append(f"{path}.{key}: (absent) -> {after[key]!r}")
            else:
                lines += differences(before[key], after[key], f"{path}.{key}")
        return lines
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def environments(baseline: Record, candidate: Record) -> tuple[list[str], list[str]]:
    """(why the environments are not comparable, the machine differences: context)."""
    native = baseline.subject.name == candidate.subject.name == "deepspeed-native"
    exclude = ("deepspeed",) if native else ()
    before, after = baseline.environment, candidate.environment
    changed = differences(
        before.fingerprint_fields(after, exclude),
        after.fingerprint_fields(before, exclude),
        "environment",
    )
    reasons = []
    if changed:
        reasons.append(
            f"environment fingerprints differ ({before.fingerprint(after, exclude)} -> "
            f"{after.fingerprint(before, exclude)}): {'; '.join(changed)}"
        )
    fields = ("platform", *MACHINE_FIELDS)
    machine = differences(
        before.model_dump(include=set(fields)), after.model_dump(include=set(fields)), "machine"
    )
    return reasons, machine


def shared_arms(baseline: Record, candidate: Record) -> tuple[list[Any], list[Any]]:
    """Each record's arms but a chunked arm the other lacks ([Note: the chunked arm])."""
    names = [{arm.name for arm in record.arms} for record in (candidate, baseline)]
    return tuple(  # type: ignore[return-value]
        [arm for arm in record.arms if arm.name in other or not arm.name.endswith(CHUNKED_SUFFIX)]
        for record, other in zip((baseline, candidate), names, strict=True)
    )


def reasons(baseline: Record, candidate: Record) -> list[str]:
    reasons = []
    if baseline.schema_version != candidate.schema_version:
        reasons.append(
            f"schema major versions differ: {baseline.schema_version} -> {candidate.schema_version}"
        )
        return reasons  # the rest of the comparison assumes one schema
    reasons += environments(baseline, candidate)[0]
    if baseline.subject.name != candidate.subject.name:
        reasons.append(f"subjects differ: {baseline.subject.name} -> {candidate.subject.name}")
    workload_changes = differences(
        baseline.workload.model_dump(exclude={"num_parameters"}),
        candidate.workload.model_dump(exclude={"num_parameters"}),
        "workload",
    )
    if workload_changes:
        reasons.append(f"workloads differ: {'; '.join(workload_changes)}")
    shared = shared_arms(baseline, candidate)
    baseline_arms = [arm.name for arm in shared[0]]
    candidate_arms = [arm.name for arm in shared[1]]
    if baseline_arms != candidate_arms:
        reasons.append(f"arms differ: {baseline_arms} -> {candidate_arms}")
    else:
        for before, after in zip(*shared, strict=True):
            arm_changes = differences(
                before.model_dump(), after.model_dump(), f"arm {before.name!r}"
            )
            if arm_changes:
                reasons.append(f"arm {before.name!r} differs: {'; '.join(arm_changes)}")
    return reasons
