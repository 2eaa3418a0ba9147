"""``probe`` from the wire's bytes ([Note: group size from the wire], qualify/evidence/wire.py):
the group size the bytes carry, per rank and process group, against the requested one;
a group size the subject reports is compared too, and never stands in for the wire."""

from __future__ import annotations

import itertools

import pytest

from qwz.qualify.evidence.rules import group_size_on_wire, in_effect
from qwz.qualify.evidence.schema import Probe, WireGroup
from qwz.qualify.evidence.wire import group_bounds, wire_bounds
from tests.unit.records import CANDIDATE, make_payload, make_record, wire_group

QUANTIZED = 579_264
"""Each rank's half of the synthetic record's parameters, all quantized."""


def spec_bytes(group_size: int, quantized: int = QUANTIZED, exact: int = 0) -> int:
    """The spec's wire: a code per quantized element, a scale per group, exact bf16."""
    return quantized + 4 * -(-quantized // group_size) + 2 * exact


def probe_check(bytes_per_step: int, requested: int = 64, reported=(64, 64)):
    payload = make_payload()
    probe = payload["probes"][0]
    probe["requested_group_size"] = requested
    probe["reported_group_sizes"] = list(reported)
    probe["wire"] = [wire_group(rank, bytes_per_step) for rank in (0, 1)]
    probe["gather_bytes_per_step"] = bytes_per_step
    if requested != 64:
        payload["arms"][2]["group_size"] = requested
    checked = {check.name: check for check in make_record(**payload).checks}
    return checked[f"probe[{CANDIDATE}]"], checked[f"in-effect[{CANDIDATE}]"]


@pytest.mark.parametrize("group_size", [8, 64, 72, 1024, 8192])
def test_the_spec_s_bytes_pass_and_imply_their_group_size(group_size):
    probe, _ = probe_check(spec_bytes(group_size), group_size, reported=(None, None))
    assert probe.status == "pass", probe.detail
    implied = probe.numbers["wire_group_sizes"][0]
    assert implied == pytest.approx(group_size, rel=0.01)


def test_groups_of_8192_on_the_wire_fail_a_request_of_64_whatever_is_reported():
    """The subject says 64 (its config echoes the request) while the wire carries 8192."""
    probe, in_effect = probe_check(spec_bytes(8192), requested=64, reported=(64, 64))
    assert probe.status == "fail"
    assert "does not carry groups of 64" in probe.detail and "outside" in probe.detail
    assert in_effect.status == "pass"  # fewer bytes than bf16: in effect, but the wrong G


def test_the_group_size_ignored_always_64_fails_a_request_of_8192():
    probe, _ = probe_check(spec_bytes(64), requested=8192, reported=(None, None))
    assert probe.status == "fail" and "does not carry groups of 8192" in probe.detail


def test_an_unquantized_wire_fails_probe_and_in_effect():
    """Stock DeepSpeed with zero_quantized_weights: bf16 on the wire, as the reference."""
    probe, in_effect = probe_check(2 * QUANTIZED, reported=(None, None))
    assert probe.status == "fail" and "does not carry groups of 64" in probe.detail
    assert in_effect.status == "fail" and "not in effect" in in_effect.detail


def test_a_reported_group_size_must_agree_with_the_request():
    probe, _ = probe_check(spec_bytes(64), requested=64, reported=(64, 128))
    assert probe.status == "fail" and "reports 128" in probe.detail


def test_no_wire_observation_on_two_ranks_fails():
    payload = make_payload()
    payload["probes"][0]["wire"] = []
    checked = {check.name: check for check in make_record(**payload).checks}
    assert checked[f"probe[{CANDIDATE}]"].status == "fail"


def test_the_allowance_covers_codes_for_every_position_and_one_padded_group():
    """qwz's drop-in sends a code for every shard position (exact ones included) padded to
    whole groups, and the exact elements again in bf16: inside the allowance."""
    group = WireGroup(
        rank=1, group_ranks=[0, 1], bytes_per_step=0, calls_per_step=1,
        quantized_numel=267_028, exact_numel=2_062, padding_numel=2, element_bytes=2,
    )  # fmt: skip
    numel = 267_028 + 2_062 + 2
    for group_size in (64, 8192):
        groups = -(-numel // group_size)
        sent = groups * group_size + 4 * groups + 2 * 2_062
        fewest, most = wire_bounds(group, group_size)
        assert fewest <= sent <= most, (group_size, fewest, sent, most)
    # ... but groups of 64 never fit a request of 8192, nor groups of 8192 one of 64.
    sent_64 = 4_205 * 64 + 4 * 4_205 + 2 * 2_062
    assert sent_64 > wire_bounds(group, 8192)[1]
    sent_8192 = 33 * 8192 + 4 * 33 + 2 * 2_062
    assert sent_8192 < wire_bounds(group, 64)[0]


def test_rows_sized_for_the_fullest_rank_pass_and_are_still_judged():
    """All-gather rows have one size on every rank: rank 0 (no exact elements) sends a row
    sized for rank 1's exact elements, as qwz's drop-in does (measured: 290,064 B each)."""
    payload = make_payload()
    probe = payload["probes"][0]
    rank_0 = wire_group(0, 290_064, quantized_numel=269_092)
    rank_1 = wire_group(1, 290_064, quantized_numel=267_028) | {
        "exact_numel": 2_062, "padding_numel": 2,
    }  # fmt: skip
    probe["wire"] = [rank_0, rank_1]
    checked = {check.name: check for check in make_record(**payload).checks}
    assert checked[f"probe[{CANDIDATE}]"].status == "pass", checked[f"probe[{CANDIDATE}]"]
    alone = wire_bounds(WireGroup(**rank_0), 64)
    assert not alone[0] <= 290_064 <= alone[1]  # judged alone, rank 0's row is too long
    probe["wire"] = [rank_0 | {"bytes_per_step": 274_592}, rank_1 | {"bytes_per_step": 274_592}]
    checked = {check.name: check for check in make_record(**payload).checks}
    assert checked[f"probe[{CANDIDATE}]"].status == "fail"  # groups of 8192 on that wire


# --------------------------------------------------------------------------------------- #
# [Note: received bytes per process group]: what each rank received, whatever the collective
# --------------------------------------------------------------------------------------- #

MLP_PARAMS = (271_153, 1_031, 264_967, 257, 771, 3)
"""The ``mlp`` workload's parameters in layout order (the biases and the head are exact)."""


def partitions(world: int, group_size: int) -> list[dict[str, list[int]]]:
    """Per rank, per position of its equal partition (whole groups), whether it is a
    quantized element, an exact one or padding: a flat buffer of MLP_PARAMS split W ways."""
    total = sum(MLP_PARAMS)
    numel = -(-total // (world * group_size)) * group_size
    kinds = []
    for size in MLP_PARAMS:
        kinds += ["exact" if size <= 65_536 else "quantized"] * size
    kinds += ["padding"] * (world * numel - total)
    return [kinds[rank * numel : (rank + 1) * numel] for rank in range(world)]


def chunk_counts(kinds: list[str], chunks: int, group_size: int) -> list[dict[str, int]]:
    """The partition cut into `chunks` chunks of whole groups: each chunk's counts."""
    groups = len(kinds) // group_size
    edges = [group_size * (groups * k // chunks) for k in range(chunks + 1)]
    return [
        {kind: kinds[start:end].count(kind) for kind in ("quantized", "exact", "padding")}
        | {"numel": end - start}
        for start, end in itertools.pairwise(edges)
    ]


def simulated_wire(scheme: str, world: int, group_size: int, chunks: int) -> list[dict]:
    """Every rank's WireGroup entry for a weight gather written `scheme`'s way."""
    ranks = partitions(world, group_size)
    per_rank = [chunk_counts(kinds, chunks, group_size) for kinds in ranks]
    exact_bytes = 4 if scheme == "fp32 exact, padded per chunk" else 2

    def row(rank: int, chunk: int) -> int:
        counts = per_rank[rank][chunk]
        codes_and_scales = counts["numel"] + 4 * counts["numel"] // group_size
        if scheme == "bf16":
            return 2 * counts["numel"]
        if scheme == "codes, no scales":
            return counts["numel"] + 2 * counts["exact"]
        if scheme.startswith("broadcast"):  # each source sends its own row: no padding
            return codes_and_scales + exact_bytes * counts["exact"]
        # one collective per chunk: every rank's row as long as the fullest rank's there
        fullest = max(per_rank[peer][chunk]["exact"] for peer in range(world))
        return codes_and_scales + exact_bytes * fullest

    rows_per_chunk = 3 if scheme == "list all_gather, three tensors a chunk" else 1
    wire = []
    for rank, kinds in enumerate(ranks):
        received = sum(row(peer, k) for peer in range(world) if peer != rank for k in range(chunks))
        wire.append(
            {
                "rank": rank,
                "group_ranks": list(range(world)),
                "bytes_per_step": sum(row(rank, k) for k in range(chunks)),
                "calls_per_step": chunks * (world if scheme.startswith("broadcast") else 1),
                "received_bytes_per_step": received,
                "rows_per_step": (world - 1) * chunks * rows_per_chunk,
                "quantized_numel": kinds.count("quantized"),
                "exact_numel": kinds.count("exact"),
                "padding_numel": kinds.count("padding"),
                "element_bytes": 2,
            }
        )
    return wire


def judged(scheme: str, world: int, group_size: int, chunks: int, **probe_fields):
    wire = simulated_wire(scheme, world, group_size, chunks)
    reference = simulated_wire("bf16", world, group_size, 1)
    probe = Probe(
        arm=CANDIDATE,
        requested_group_size=group_size,
        reported_group_sizes=[None] * world,
        wire=wire,
        gather_bytes_per_step=wire[0]["bytes_per_step"],
        reference_gather_bytes_per_step=reference[0]["bytes_per_step"],
        reference_wire=reference,
        **probe_fields,
    )
    return group_size_on_wire.probe(probe, world, None), in_effect.in_effect(probe, world, None)


CORRECT = (
    "all_gather_into_tensor, padded per chunk",
    "fp32 exact, padded per chunk",
    "broadcast per source",
    "list all_gather, three tensors a chunk",
)


@pytest.mark.parametrize("scheme", CORRECT)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group_size", [64, 8192])
@pytest.mark.parametrize("chunks", [1, 3])
def test_a_correct_gather_passes_whatever_its_collective_and_packing(
    scheme, world, group_size, chunks
):
    probe, in_effect = judged(scheme, world, group_size, chunks)
    assert probe.status == "pass", probe.detail
    assert in_effect.status == "pass", in_effect.detail
    if group_size == 64:  # the implied G is context: padding codes blur it at 8192
        assert probe.numbers["wire_group_sizes"][0] == pytest.approx(group_size, rel=0.5)


def test_the_known_false_failure_now_passes_and_the_old_rule_still_fails_it():
    """Exact elements padded per chunk to the fullest rank's count, in fp32, at W = 4: the
    bytes sent exceed the sent-bytes rule's most (the record of an older harness), while
    the received-bytes rule allows them."""
    wire = simulated_wire("fp32 exact, padded per chunk", 4, 64, 3)
    fullest = max(wire, key=lambda item: item["exact_numel"])
    groups = [WireGroup(**item) for item in wire]
    old_most = group_bounds(groups, WireGroup(**fullest), 64)[1]
    assert fullest["bytes_per_step"] > old_most
    probe, _ = judged("fp32 exact, padded per chunk", 4, 64, 3)
    assert probe.status == "pass", probe.detail


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group_size", [64, 8192])
def test_unquantized_bf16_on_the_wire_fails_probe_and_in_effect(world, group_size):
    probe, in_effect = judged("bf16", world, group_size, 1)
    assert probe.status == "fail" and "outside" in probe.detail
    assert in_effect.status == "fail" and "not in effect" in in_effect.detail


@pytest.mark.parametrize("world", [2, 4])
def test_too_few_bytes_fail_probe(world):
    """Codes and exact elements without the scales: fewer bytes than the spec's encoding."""
    probe, in_effect = judged("codes, no scales", world, 64, 1)
    assert probe.status == "fail" and "outside" in probe.detail, probe.detail
    assert in_effect.status == "pass"  # fewer bytes than bf16: in effect, but not the spec


def test_groups_of_8192_on_the_wire_fail_a_request_of_64_by_received_bytes():
    wire = simulated_wire("broadcast per source", 2, 8192, 1)
    probe = Probe(
        arm=CANDIDATE, requested_group_size=64, reported_group_sizes=[64, 64], wire=wire,
        gather_bytes_per_step=0, reference_gather_bytes_per_step=0,
    )  # fmt: skip
    assert group_size_on_wire.probe(probe, 2, None).status == "fail"


@pytest.mark.parametrize("scheme", ["broadcast per source", "bf16"])
def test_uncounted_calls_make_probe_and_in_effect_inconclusive(scheme):
    """A pass and a fail alike: with unattributed collectives the account is incomplete."""
    probe, in_effect = judged(
        scheme, 2, 64, 1, uncounted_calls=3, uncounted=["_c10d_functional.all_gather_into_tensor"]
    )
    for check in (probe, in_effect):
        assert check.status == "inconclusive" and "_c10d_functional" in check.detail


def test_in_effect_compares_each_rank_and_group_with_the_reference_s():
    """Rank 1 receives bf16 while rank 0 receives codes: fewer bytes in total, but not on
    every rank and group, so not in effect."""
    wire = simulated_wire("broadcast per source", 2, 64, 1)
    reference = simulated_wire("bf16", 2, 64, 1)
    wire[1]["received_bytes_per_step"] = reference[1]["received_bytes_per_step"]
    probe = Probe(
        arm=CANDIDATE, requested_group_size=64, reported_group_sizes=[None, None], wire=wire,
        gather_bytes_per_step=1, reference_gather_bytes_per_step=2, reference_wire=reference,
    )  # fmt: skip
    check = in_effect.in_effect(probe, 2, None)
    assert check.status == "fail" and "rank 1" in check.detail, check.detail


def test_the_received_rule_runs_in_a_record():
    """derive() judges a record with received bytes by them (two ranks, the synthetic record)."""
    payload = make_payload()
    probe = payload["probes"][0]
    half = QUANTIZED + 4 * -(-QUANTIZED // 64)
    probe["wire"] = [
        wire_group(rank, half) | {"received_bytes_per_step": half, "rows_per_step": 1}
        for rank in (0, 1)
    ]
    probe["reference_wire"] = [
        wire_group(rank, 2 * QUANTIZED) | {"received_bytes_per_step": 2 * QUANTIZED}
        for rank in (0, 1)
    ]
    checked = {check.name: check for check in make_record(**payload).checks}
    assert checked[f"probe[{CANDIDATE}]"].status == "pass"
    assert "received" in checked[f"probe[{CANDIDATE}]"].detail
    assert checked[f"in-effect[{CANDIDATE}]"].status == "pass"
    assert "every rank and process group" in checked[f"in-effect[{CANDIDATE}]"].detail
