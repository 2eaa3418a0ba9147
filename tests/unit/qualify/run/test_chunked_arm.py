"""[Note: the chunked arm] (qwz/qualify/run/chunked_arm.py): the default qualification holds a
candidate arm whose gather spans several chunks per rank, with edges inside parameters, sized
from the workload; the plan and the record carry its bucket."""

from __future__ import annotations

import copy
import math

import pytest

from qwz.qualify import cli
from qwz.qualify.base.plan import CHUNKED_SUFFIX
from qwz.qualify.evidence import chunking, staging
from qwz.qualify.review.compare import Status, compare
from qwz.qualify.run import chunked_arm
from qwz.qualify.run.workloads import get_workload
from tests.unit.records import CANDIDATE, make_payload, make_record
from tests.unit.run_requests import plan_of as resolved_plan

DEFAULT_BUCKET = 500_000_000


def pr_chunks_per_rank(group: chunking.GatheredGroup, bucket: int, group_size: int) -> int:
    """Chunks per rank of the PR's chunking (``bucket // (W * G)`` groups per rank)."""
    per_rank = max(1, bucket // (group.world_size * group_size)) * group_size
    partition = math.ceil(sum(group.numels) / group.world_size)
    return math.ceil(partition / per_rank)


@pytest.mark.parametrize("workload", ["mlp", "mlp-small"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("group_size", [64, 8192])
def test_the_sized_bucket_chunks_every_gather_within_the_bound(
    workload, world_size, dtype, group_size
):
    bucket = chunked_arm.chunked_bucket(
        get_workload(workload),
        world_size=world_size,
        seed=0,
        group_sizes=(group_size,),
        dtype=dtype,
        allgather_bucket_size=DEFAULT_BUCKET,
    )
    assert bucket is not None and bucket % (world_size * group_size) == 0
    element_bytes = chunked_arm.ELEMENT_BYTES[dtype]
    for group in chunked_arm.gathered_groups(get_workload(workload), world_size, 0):
        assert pr_chunks_per_rank(group, bucket, group_size) >= 3
        assert chunking.edges_inside_parameters(group, bucket, group_size)
        fewest = chunking.fewest_wire_bytes(group, group_size, element_bytes)
        exact = sum(numel for numel in group.numels if numel <= 65_536)
        bound = staging.collective_bound(
            bucket=bucket,
            world_size=world_size,
            group_size=group_size,
            element_bytes=element_bytes,
            rank_exact_numel=exact,
        )
        if bucket > world_size * group_size:  # not the one-group-per-rank floor
            assert chunking.CHUNK_TARGET * bound.bound_bytes <= fewest


def test_the_expert_groups_are_gathered_over_the_expert_data_parallel_ranks():
    pytest.importorskip("deepspeed")
    groups = chunked_arm.gathered_groups(get_workload("moe-tiny"), 4, 0)
    assert sorted(group.world_size for group in groups) == [2, 4]
    bucket = chunked_arm.chunked_bucket(
        get_workload("moe-tiny"),
        world_size=4,
        seed=0,
        group_sizes=(64,),
        dtype="bf16",
        allgather_bucket_size=DEFAULT_BUCKET,
    )
    assert all(pr_chunks_per_rank(group, bucket, 64) >= 3 for group in groups)


def test_an_edge_on_a_parameter_s_first_element_or_in_padding_is_not_inside():
    inside = chunking.GatheredGroup((100, 156), 1)  # edges 64, 128, 192
    assert chunking.edges_inside_parameters(inside, 64, 64)
    on_a_start = chunking.GatheredGroup((128, 128), 1)  # edge 128: the second's first element
    assert not chunking.edges_inside_parameters(on_a_start, 64, 64)
    padded = chunking.GatheredGroup((100,), 2)  # partitions of 50: rank 1's edge 48 -> 98
    assert chunking.edges_inside_parameters(padded, 2 * 8, 8)  # 8-element chunks
    tail = chunking.GatheredGroup((90,), 2)  # partitions of 45: rank 1's edge 40 -> 85
    assert chunking.edges_inside_parameters(tail, 2 * 40, 8)
    assert not chunking.edges_inside_parameters(chunking.GatheredGroup((81,), 2), 80, 8)


def test_a_run_whose_bucket_already_chunks_or_one_rank_gets_no_chunked_arm():
    def bucket_for(bucket: int, world_size: int = 2) -> int | None:
        return chunked_arm.chunked_bucket(
            get_workload("mlp"),
            world_size=world_size,
            seed=0,
            group_sizes=(64,),
            dtype="bf16",
            allgather_bucket_size=bucket,
        )

    sized = bucket_for(DEFAULT_BUCKET)
    assert sized is not None and bucket_for(sized + 1) == sized
    assert bucket_for(sized) is None and bucket_for(8_192) is None
    assert bucket_for(DEFAULT_BUCKET, world_size=1) is None


def plan_of(*argv: str):
    return resolved_plan(cli.build_parser().parse_args(["run", "--out", "x", *argv]))


def test_the_default_plan_has_the_chunked_arm_with_its_own_bucket_untimed():
    plan = plan_of("--workload", "mlp", "--group-size", "64", "--group-size", "8192")
    names = [arm.name for arm in plan.arms]
    assert names[-1] == "candidate-g64-chunked" and names.count("candidate-g64-chunked") == 1
    chunked = plan.arms[-1]
    assert chunked.group_size == 64 and chunked.quantized and not chunked.timed
    assert chunked.allgather_bucket_size == plan.chunked_allgather_bucket_size < DEFAULT_BUCKET
    assert [arm.name for arm in plan.arms if arm.timed] == ["candidate-g64", "candidate-g8192"]
    zero = plan.arm_config(chunked)["zero_optimization"]
    assert zero["allgather_bucket_size"] == chunked.allgather_bucket_size
    assert zero["reduce_bucket_size"] == plan.reduce_bucket_size == DEFAULT_BUCKET
    user = plan.arm_config(plan.arms[2])["zero_optimization"]
    assert user["allgather_bucket_size"] == DEFAULT_BUCKET
    assert plan_of("--workload", "mlp", "--allgather-bucket-size", "8192").arms[-1].name == (
        "candidate-g64"
    )


def with_chunked_arm(largest_output_bytes: int | None = None, suffix: str = CHUNKED_SUFFIX) -> dict:
    """The synthetic record with a chunked sibling of its candidate (a copy under the chunked
    arm's name and its own bucket), its largest collective `largest_output_bytes`."""
    payload = make_payload()
    chunked = f"{CANDIDATE}{suffix}"
    for section in ("arms", "trajectories", "step_one", "updates", "own_shards", "drift",
                    "hashes", "probes", "memory"):  # fmt: skip
        for item in [item for item in payload[section] if CANDIDATE in item.values()]:
            copied = copy.deepcopy(item)
            copied["name" if section == "arms" else "arm"] = chunked
            payload[section].append(copied)
    arm = payload["arms"][-1]
    arm["allgather_bucket_size"] = 300_000
    arm["config"]["zero_optimization"]["allgather_bucket_size"] = 300_000
    for group in payload["probes"][-1]["wire"]:
        group["largest_output_bytes"] = largest_output_bytes or group["largest_output_bytes"] // 4
    return payload


def test_a_baseline_without_the_chunked_arm_compares_with_a_record_that_has_it():
    """The gate keeps working across the harness change: the chunked arm's checks are new."""
    baseline, candidate = make_record(), make_record(**with_chunked_arm())
    comparison = compare(baseline, candidate)
    assert comparison.status == Status.NO_REGRESSION, comparison.text()
    assert "check 'bounded[candidate-g64-chunked]' is new and passes" in comparison.lines
    assert compare(candidate, baseline).status == Status.NO_REGRESSION
    broken = make_record(**with_chunked_arm(largest_output_bytes=10**9))
    assert compare(baseline, broken).status == Status.REGRESSION
    other = make_record(**with_chunked_arm(suffix="-other"))  # any other arm: incomparable
    assert "arms differ" in compare(baseline, other).text()
