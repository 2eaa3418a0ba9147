"""The checks and the verdict, derived from a record's raw observations alone.

``derive(record)`` is a pure function of what a record stores; ``evidence``
calls it to write a record and ``record.load`` calls it again on every load, so
a stored check that does not follow from the stored data makes the record
invalid. Each check has a status: ``pass``, ``fail``, ``n/a`` (nothing to test,
with the reason) or ``inconclusive``; see ``seal.verdict_of``.

Which checks decide, and why (DESIGN.md, "What makes a verdict trustworthy"):
exactness where it exists -- the step-1 masters, every step's update, the own
shard's decode, the small parameters, the replicas -- and learning. The drift
of sampled parameters from the reference is context: its bound holds for any
two AdamW trajectories, so it cannot tell a learning candidate from a broken
one.

Each family's rule is its own module under rules/ (rules/__init__.py lists them, with each
rule's version); this module composes them, in the order the record stores the checks.
"""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence.rules import (
    bounded,
    conformance,
    exact_update,
    finite,
    group_size_on_wire,
    identical_replicas,
    in_effect,
    learning,
    overflow_pattern,
    reproduced,
    schemes,
    speedup,
    step_one,
)
from qwz.qualify.evidence.schema import Check, Record


def _failures(record: Record) -> dict[str, Any]:
    return {t.arm: t.failure for t in record.trajectories}


def derive(record: Record) -> list[Check]:
    """Every check, recomputed from the record's observations (module docstring), in the
    order the record stores them."""
    arms = {arm.name: arm for arm in record.arms}
    reference = next((arm.name for arm in record.arms if arm.role == "reference"), None)
    candidates = [arm for arm in record.arms if arm.role == "candidate"]
    failures = _failures(record)
    world_size = record.environment.world_size
    digests = {item.arm: item for item in record.step_one}
    skips = overflow_pattern.arm_skips(record)
    checks = [
        finite.finite(trajectory, skips.get(trajectory.arm)) for trajectory in record.trajectories
    ]
    checks += [step_one.step_one(arm.name, digests, reference) for arm in candidates]
    checks += [
        exact_update.update(updates, skips.get(updates.arm), arms[updates.arm].config)
        for updates in record.updates
    ]
    checks += overflow_pattern.overflow_patterns(record, reference)
    run_scheme = schemes.run_scheme(record)
    checks += [
        schemes.own_shard(own, arms[own.arm].quantized, failures.get(own.arm), run_scheme)
        for own in record.own_shards
    ]
    for hashes in record.hashes:
        checks += [identical_replicas.replicas(hashes, world_size), reproduced.reproduced(hashes)]
    for probe in record.probes:
        failure = failures.get(probe.arm)
        checks.append(group_size_on_wire.probe(probe, world_size, failure))
        checks.append(in_effect.in_effect(probe, world_size, failure))
    checks += bounded.bounded_checks(record)
    checks += learning.learning(record, reference, candidates)
    if record.plan.min_speedup is not None:
        minimum = record.plan.min_speedup
        checks += [speedup.speedup(item, minimum) for item in record.performance]
    checks.append(conformance.conformance(record))
    return checks
