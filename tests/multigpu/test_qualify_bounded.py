"""Chunk edges and the staging bound, judged by default ([Note: the chunked arm],
qwz/qualify/run/chunked_arm.py; [Note: the staging bound], qwz/qualify/evidence/staging.py).

The plan is the default qualification's at CI size (the ``mlp`` workload, four steps, no speed
blocks, the run's default bucket of 5e8, which holds each rank's partition in one chunk) with
the chunked arm the CLI adds (``run_request.resolve`` sizes it with the same function). Each
mutant of ``mutants.CHUNKED_KILLED_BY`` is wrong only where a gather chunks: it must FAIL
naming its check on the chunked arm, while the arm with the run's own bucket -- the same code --
passes that check; the correct candidate PASSes with ``bounded`` carrying evidence on both.
"""

from __future__ import annotations

import dataclasses

import pytest

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.run.chunked_arm import chunked_bucket
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload

from . import mutants

pytestmark = pytest.mark.multigpu

CANDIDATE, CHUNKED = "candidate-g64", "candidate-g64-chunked"


def default_plan(subject: str, world_size: int, mutant: str | None = None) -> RunPlan:
    plan = RunPlan(workload=get_workload("mlp"), subject=subject, steps=4, blocks=0,
                   eval_every=2)  # fmt: skip
    bucket = chunked_bucket(
        plan.workload,
        world_size=world_size,
        seed=plan.seed,
        group_sizes=plan.group_sizes,
        dtype=plan.dtype,
        allgather_bucket_size=plan.allgather_bucket_size,
    )
    hook = None if mutant is None else f"tests.multigpu.mutants:{mutant}"
    return dataclasses.replace(plan, chunked_allgather_bucket_size=bucket, arm_hook=hook)


def qualify(worlds, plan: RunPlan, world_size: int):
    return evidence.build_record(plan, worlds.get(world_size).run(qualify_rank, plan)[0])


def checks_of(record):
    return {check.name: check for check in record.checks}


def _sizes(*names: str):
    """Each case at world size 2 (CI) and 4 (the nightly)."""
    for world_size in (2, 4):
        marks = [] if world_size == 2 else [pytest.mark.nightly]
        yield pytest.param(*names, world_size, id="-".join([*names, f"W{world_size}"]), marks=marks)


@pytest.mark.parametrize(
    ("subject", "world_size"),
    [case for subject in ("qwz", "deepspeed") for case in _sizes(subject)],
)
def test_the_correct_candidate_passes_with_its_gather_chunked(worlds, subject, world_size):
    if subject == "deepspeed":
        pytest.importorskip("deepspeed")
    record = qualify(worlds, default_plan(subject, world_size), world_size)
    assert record.verdict.status == "PASS", [c for c in record.checks if c.status != "pass"]
    checks = checks_of(record)
    chunked = checks[f"bounded[{CHUNKED}]"]
    assert chunked.passed and chunked.numbers["calls_per_step"] >= 3, chunked
    assert checks[f"bounded[{CANDIDATE}]"].numbers["calls_per_step"] == 1
    for family in ("step1-exact", "own-shard", "replicas", "bounded"):
        assert f"{family}[{CHUNKED}]" in record.verdict.evidence
    # Chunks of whole groups change no decoded value: the arms trained alike.
    hashes = {item.arm: item.per_rank for item in record.hashes}
    assert hashes[CHUNKED] == hashes[CANDIDATE]


KILLED = [
    (mutant, subject)
    for mutant in mutants.CHUNKED_KILLED_BY
    for subject in ("qwz", "deepspeed")
    if not (mutant == "groups_restart_at_chunk_edge" and subject == "deepspeed")
]


@pytest.mark.parametrize(
    ("mutant", "subject", "world_size"), [case for item in KILLED for case in _sizes(*item)]
)
def test_a_mutant_wrong_only_where_it_chunks_fails_by_default(worlds, mutant, subject, world_size):
    if subject == "deepspeed":
        pytest.importorskip("deepspeed")
    record = qualify(worlds, default_plan(subject, world_size, mutant), world_size)
    family = mutants.CHUNKED_KILLED_BY[mutant]
    failed = {
        name: check.detail for name, check in checks_of(record).items() if check.status == "fail"
    }
    assert record.verdict.status == "FAIL" and f"{family}[{CHUNKED}]" in failed, failed
    # Only the chunked arm shows it: the same code with the run's own bucket passes.
    assert checks_of(record)[f"{family}[{CANDIDATE}]"].passed
    assert all(CHUNKED in name for name in failed), failed
    if family == "bounded":
        assert set(failed) == {f"bounded[{CHUNKED}]"}, failed  # no other check sees it
        assert "exceeds the staging bound" in failed[f"bounded[{CHUNKED}]"]
