"""The ``moe-tiny`` qualification: DeepSpeed's MoE layer through the deepspeed subject.

With expert parallelism 2, world size 2 gives each rank two experts of its own (their
expert-data-parallel groups are one rank: a local copy, nothing on the wire) and world
size 4 puts each expert on two ranks ({0, 2} hold experts 0-1, {1, 3} experts 2-3), gathered
over that pair. Every check that compares ranks compares a parameter over the ranks holding
it ([Note: replica sets], qwz/qualify/run/replicas.py): the correct candidate PASSes at
both world sizes although different ranks hold different experts under one parameter name,
and the MoE mutants (tests/multigpu/mutants.py ``MOE_KILLED_BY``) FAIL naming their check.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("deepspeed", reason="the moe-tiny workload needs DeepSpeed's MoE layer")

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload

from . import mutants

pytestmark = pytest.mark.multigpu

CANDIDATE = "candidate-g64"
PLAN = RunPlan(
    workload=get_workload("moe-tiny"),
    subject="deepspeed",
    steps=8,
    blocks=0,  # speed is not what these break; no timing
    eval_every=2,
)
EXPERT_SETS = {2: [[0], [0], [1], [1]], 4: [[0, 2], [0, 2], [1, 3], [1, 3]]}
"""World size -> the ranks holding experts 0, 1, 2 and 3 (DeepSpeed's expert-then-data
layout: the expert-parallel rank is the global rank modulo ep_size)."""


_RECORDS: dict[tuple[int, str | None], object] = {}


def _qualify(worlds, world_size: int, mutant: str | None = None):
    """The record of PLAN (with `mutant`) at `world_size`, run once per session."""
    if (world_size, mutant) not in _RECORDS:
        hook = None if mutant is None else f"tests.multigpu.mutants:{mutant}"
        plan = dataclasses.replace(PLAN, arm_hook=hook)
        observations = worlds.get(world_size).run(qualify_rank, plan)[0]
        _RECORDS[world_size, mutant] = evidence.build_record(plan, observations)
    return _RECORDS[world_size, mutant]


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_correct_candidate_passes_with_every_check_per_replica_set(worlds, world_size):
    record = _qualify(worlds, world_size)
    assert record.verdict.status == "PASS", [c for c in record.checks if c.status != "pass"]
    for family in ("step1-exact", "update", "own-shard", "replicas", "learning", "in-effect"):
        assert f"{family}[{CANDIDATE}]" in record.verdict.evidence
    hashes = next(item for item in record.hashes if item.arm == CANDIDATE)
    sets = {item.params: item.ranks for item in hashes.replica_sets}
    assert sets.pop("dense") == list(range(world_size))
    assert [sets[f"expert{index}"] for index in range(4)] == EXPERT_SETS[world_size]
    # Different experts under one name on different ranks: the per-rank hashes differ, the
    # sets' hashes agree.
    assert len(set(hashes.per_rank)) == 2
    digests = next(item.digests for item in record.step_one if item.arm == CANDIDATE)
    assert {name.rsplit("@", 1)[1] for name in digests if "@" in name} == {
        "expert0",
        "expert1",
        "expert2",
        "expert3",
    }


def test_the_wire_is_recorded_per_group_dense_and_expert(worlds):
    record = _qualify(worlds, 4)
    probe = next(item for item in record.probes if item.arm == CANDIDATE)
    by_kind: dict[str, set] = {}
    for group in probe.wire:
        by_kind.setdefault(group.params, set()).add(tuple(group.group_ranks))
        assert group.calls_per_step == 1 and group.bytes_per_step > 0, group
    assert by_kind == {"dense": {(0, 1, 2, 3)}, "expert": {(0, 2), (1, 3)}}
    check = next(c for c in record.checks if c.name == f"probe[{CANDIDATE}]")
    assert check.status == "pass" and "over ranks [0, 2]" in check.detail


def test_one_rank_expert_groups_send_nothing_and_are_not_judged_by_the_wire(worlds):
    record = _qualify(worlds, 2)
    probe = next(item for item in record.probes if item.arm == CANDIDATE)
    experts = [group for group in probe.wire if group.params == "expert"]
    assert [group.group_ranks for group in experts] == [[0], [1]]
    assert all(group.bytes_per_step == 0 for group in experts)
    check = next(c for c in record.checks if c.name == f"probe[{CANDIDATE}]")
    assert check.status == "pass" and "one-rank groups [0], [1]" in check.detail


@pytest.mark.parametrize("mutant", sorted(mutants.MOE_KILLED_BY))
def test_moe_mutants_are_killed_naming_the_check(worlds, mutant):
    record = _qualify(worlds, 4, mutant)
    expected = f"{mutants.MOE_KILLED_BY[mutant]}[{CANDIDATE}]"
    failing = {check.name: check.detail for check in record.checks if check.status == "fail"}
    assert record.verdict.status == "FAIL", f"{mutant} survived: {record.verdict}"
    assert expected in failing, f"{mutant}: {expected} did not fail; failed: {failing}"
    assert all(CANDIDATE in name for name in failing), failing
    if mutant == "expert_replica_drifts_on_last_rank":
        # Seen only by comparing the ranks that hold the expert; its own shard is the peer's.
        assert "@expert" in failing[expected] and "(ranks 1, 3)" in failing[expected]
        assert f"own-shard[{CANDIDATE}]" not in failing
