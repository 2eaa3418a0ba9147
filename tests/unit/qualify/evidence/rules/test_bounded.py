"""``bounded``: the judge's staging bound ([Note: the staging bound], qwz/qualify/evidence/
staging.py) and its check (qwz/qualify/evidence/rules/bounded.py), on synthetic records.

The bound is a statement about every packing the contract allows, so it is tested as one: any
chunk a correct gather may send within the bucket, packed the widest way the contract allows,
fits; and the check fails a collective one byte over it.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import given

from qwz.qualify.evidence import rejudge, staging
from tests.unit.records import (
    CANDIDATE,
    REFERENCE,
    make_payload,
    make_record,
    non_finite_failure,
)

MIB = 2**20


@st.composite
def correct_chunks(draw):
    """(the bound's arguments, the output bytes of one chunk of a correct gather): every rank
    sends its share of at most E elements (``E // W`` positions, or fewer at a partition's
    end), a code for every position padded to whole groups, a scale per group, the exact
    values of the rank with the most in the chunk in every row (as fp32 or the working dtype),
    and each row aligned by up to 48 bytes."""
    world = draw(st.integers(2, 8))
    group_size = draw(st.sampled_from([8, 16, 64, 256, 8192]))
    element_bytes = draw(st.sampled_from([2, 4]))
    bucket = draw(st.integers(1, 1 << 22))
    positions = draw(st.integers(1, staging.chunk_elements(bucket, world, group_size) // world))
    rank_exact = draw(st.integers(0, 1 << 22))
    exact_in_rows = draw(st.lists(st.integers(0, min(positions, rank_exact)), min_size=world,
                                  max_size=world))  # fmt: skip
    exact_bytes = draw(st.sampled_from([element_bytes, 4]))
    groups = -(-positions // group_size)
    row = (
        groups * group_size
        + staging.SCALE_BYTES * groups
        + max(exact_in_rows) * exact_bytes
        + draw(st.integers(0, staging.ROW_ALIGNMENT_BYTES))
    )
    arguments = {
        "bucket": bucket,
        "world_size": world,
        "group_size": group_size,
        "element_bytes": element_bytes,
        "rank_exact_numel": rank_exact,
    }
    return arguments, world * row


@given(correct_chunks())
def test_every_correct_chunk_within_the_bucket_fits_the_bound(chunk):
    arguments, output = chunk
    assert output <= staging.collective_bound(**arguments).bound_bytes


def test_the_bound_is_the_bucket_in_the_working_dtype_at_least_one_group_per_rank():
    no_exact = {"world_size": 4, "group_size": 64, "element_bytes": 2, "rank_exact_numel": 0}
    bound = staging.collective_bound(bucket=1_000_000, **no_exact)
    assert bound.chunk_elements == 1_000_000
    assert bound.bound_bytes == 2_000_000 + 4 * staging.row_padding_bytes(64)
    tiny = staging.collective_bound(bucket=10, **no_exact)  # at least one group per rank
    assert tiny.chunk_elements == 4 * 64
    assert tiny.bound_bytes == 4 * 64 * 2 + 4 * (64 + 51)
    with_exact = staging.collective_bound(bucket=1_000_000, **(no_exact | {"rank_exact_numel": 7}))
    assert with_exact.bound_bytes == bound.bound_bytes + 4 * 7 * 4  # every row, fp32 values
    with pytest.raises(ValueError, match="allgather_bucket_size: 0 is invalid"):
        staging.collective_bound(bucket=0, **no_exact)
    with pytest.raises(ValueError, match="rank_exact_numel: -1 is invalid"):
        staging.collective_bound(bucket=1, **(no_exact | {"rank_exact_numel": -1}))


# --------------------------------------------------------------------------- the check


def bounded_payload(largest: int, *, bucket: int = 300_000, memory=None, **wire) -> dict:
    """The synthetic record's candidate (G = 64, bf16, two ranks) with its own bucket and
    each rank's largest weight-gather collective `largest`."""
    payload = make_payload()
    candidate = next(arm for arm in payload["arms"] if arm["name"] == CANDIDATE)
    candidate["allgather_bucket_size"] = bucket
    for group in payload["probes"][0]["wire"]:
        group.update({"largest_output_bytes": largest, **wire})
    if memory is not None:
        payload["memory"] = memory
    return payload


def bounded_check(payload: dict):
    record = make_record(**payload)
    return next(check for check in record.checks if check.name == f"bounded[{CANDIDATE}]")


BOUND = staging.collective_bound(
    bucket=300_000, world_size=2, group_size=64, element_bytes=2, rank_exact_numel=0
).bound_bytes


@given(st.integers(1, 2 * BOUND))
def test_the_check_fails_exactly_the_collectives_over_the_bound(largest):
    check = bounded_check(bounded_payload(largest))
    assert check.status == ("fail" if largest > BOUND else "pass"), check.detail
    assert check.numbers["bound_bytes"] == BOUND
    assert check.numbers["largest_output_bytes"] == largest


def test_a_failure_names_the_rank_the_group_the_bytes_and_the_bound():
    check = bounded_check(bounded_payload(BOUND + 1))
    assert check.status == "fail"
    assert f"rank 0 over ranks [0, 1]: {BOUND + 1:,} B > {BOUND:,} B" in check.detail
    assert "allgather_bucket_size 300,000" in check.detail


def test_the_bound_counts_the_exact_elements_of_the_fullest_rank():
    payload = bounded_payload(BOUND + 1000)
    payload["probes"][0]["wire"][1]["exact_numel"] = 100  # 2 rows x 100 fp32 values = 800 B
    assert bounded_check(payload).status == "fail"
    payload["probes"][0]["wire"][1]["exact_numel"] = 125  # 1,000 B
    assert bounded_check(payload).status == "pass"


def memory_entries(kind: str, reference: int, candidate: int) -> list[dict]:
    return [
        {"arm": arm, "rank": rank, "kind": kind, "peak_allocated_bytes": peak}
        for arm, peak in ((REFERENCE, reference), (CANDIDATE, candidate))
        for rank in (0, 1)
    ]


def allowance() -> int:
    payload = bounded_payload(1)
    wire = payload["probes"][0]["wire"]
    numel = sum(group["quantized_numel"] for group in wire)
    bound = staging.collective_bound(
        bucket=300_000, world_size=2, group_size=64, element_bytes=2, rank_exact_numel=0
    )
    return staging.memory_allowance_bytes(bound, exact_numel=0, gathered_numel=numel)


def test_cuda_memory_decides_within_its_allowance():
    base = 10 * 2**30
    within = bounded_check(
        bounded_payload(1, memory=memory_entries("cuda", base, base + allowance()))
    )
    assert within.status == "pass" and "within the allowance" in within.detail
    assert within.numbers["memory_excess_bytes"] == allowance()
    over = bounded_check(
        bounded_payload(1, memory=memory_entries("cuda", base, base + allowance() + 1))
    )
    assert over.status == "fail" and "beyond the allowance" in over.detail
    # The wire was within its bound: the failure is memory's, and says so.
    assert over.detail.startswith("every weight-gather collective within the staging bound")


def test_host_rss_is_context_and_never_fails_a_correct_candidate():
    noisy = memory_entries("rss", 600 * MIB, 600 * MIB + 50 * allowance())
    check = bounded_check(bounded_payload(1, memory=noisy))
    assert check.status == "pass"
    assert "context only, never judged" in check.detail
    assert check.numbers["memory_kind"] == "rss"


def test_memory_of_other_kinds_is_not_compared():
    mixed = memory_entries("cuda", 1, 1)
    for entry in mixed:
        if entry["arm"] == REFERENCE:
            entry["kind"] = "rss"
    check = bounded_check(bounded_payload(1, memory=mixed))
    assert check.status == "pass" and "no peak of the reference" in check.detail


@pytest.mark.parametrize(
    ("edit", "status", "detail"),
    [
        (lambda p: p["environment"].update(world_size=1), "inconclusive", "one rank"),
        (lambda p: p["probes"][0].update(uncounted_calls=3, uncounted=["Backend.allgather"]),
         "inconclusive", "could not be attributed"),
        (lambda p: [g.pop("largest_output_bytes") for g in p["probes"][0]["wire"]], "n/a",
         "not observed"),
        (lambda p: [g.update(largest_output_bytes=0) for g in p["probes"][0]["wire"]], "n/a",
         "nothing was gathered"),
        (lambda p: [g.update(group_ranks=[g["rank"]]) for g in p["probes"][0]["wire"]], "n/a",
         "nothing was gathered"),
    ],
)  # fmt: skip
def test_what_the_wire_cannot_decide(edit, status, detail):
    """One rank, collectives not attributed, a record before the largest output was kept,
    nothing gathered (nothing at all, or only over one-rank groups): never a pass or fail."""
    payload = bounded_payload(BOUND)
    edit(payload)
    check = bounded_check(payload)
    assert check.status == status and detail in check.detail, check


def test_a_schema_4_record_reads_not_observed_and_its_arms_get_their_config_s_bucket():
    payload = bounded_payload(BOUND + 1)  # would fail if it had been observed
    old = copy.deepcopy(payload) | {"schema_version": 4}
    for group in old["probes"][0]["wire"]:
        del group["largest_output_bytes"]
    for arm in old["arms"]:
        del arm["allgather_bucket_size"]
    absent = rejudge.absent_inputs(old)
    assert absent == {"probes[].wire[].largest_output_bytes"}
    from qwz.qualify.evidence import upgrade

    upgraded, version = upgrade.upgrade(old)
    assert version == 4
    assert [arm["allgather_bucket_size"] for arm in upgraded["arms"]] == [50_000_000] * 3
    record = make_record(**upgraded)
    [check] = [c for c in rejudge.rejudge(record, absent).checks if c.name.startswith("bounded")]
    assert check.status == "n/a" and check.detail.startswith("not observed: the record's schema")


def test_a_nested_input_is_absent_where_any_entry_lacks_it():
    payload = make_payload()
    assert "probes[].wire[].largest_output_bytes" not in rejudge.absent_inputs(payload)
    del payload["probes"][0]["wire"][1]["largest_output_bytes"]
    assert "probes[].wire[].largest_output_bytes" in rejudge.absent_inputs(payload)
    del payload["probes"][0]["wire"]
    assert "probes[].wire[].largest_output_bytes" in rejudge.absent_inputs(payload)


def test_an_arm_that_failed_before_a_gather_is_not_judged():
    payload = bounded_payload(0)
    trajectory = next(t for t in payload["trajectories"] if t["arm"] == CANDIDATE)
    trajectory["failure"] = non_finite_failure(1, 0, "NonFiniteStep: step 1: loss nan")
    check = bounded_check(payload)
    assert check.status == "n/a" and check.detail.startswith("the arm failed before"), check


def _with_staging(candidate_peak: int | None, reference_peak: int | None = 0):
    payload = make_payload()
    for item in payload["memory"]:
        peak = reference_peak if item["arm"] == REFERENCE else candidate_peak
        item["staging_peak_bytes"] = peak
        item["staging_largest"] = [] if peak is None else [[peak, "runtime/utils.py:1116 in f"]]
    return make_record(memory=payload["memory"])


def _bounded(record):
    return next(check for check in record.checks if check.name == f"bounded[{CANDIDATE}]")


def test_the_gathers_memory_within_its_allowance_passes_and_one_byte_over_fails():
    """[Note: the gather's memory, exactly]: the storage held at once in a step's window, over
    the reference's on the same rank, against the allowance of the candidate's bucket."""
    within = _bounded(_with_staging(1000, reference_peak=1000))
    allowance = within.numbers["staging_allowance_bytes"]
    assert within.status == "pass" and within.numbers["staging_excess_bytes"] == 0
    at = _bounded(_with_staging(allowance + 5000, reference_peak=5000))
    assert at.status == "pass" and at.numbers["staging_excess_bytes"] == allowance
    over = _bounded(_with_staging(allowance + 5001, reference_peak=5000))
    assert over.status == "fail" and "beyond the allowance" in over.detail
    assert f"{allowance + 5001:,} B at runtime/utils.py:1116 in f" in over.detail


def test_a_record_without_the_gathers_memory_is_judged_on_the_wire_alone():
    check = _bounded(_with_staging(None, reference_peak=None))
    assert check.status == "pass" and "gather memory: not observed" in check.detail
    assert "staging_excess_bytes" not in check.numbers
