"""``probe`` from the wire's bytes ([Note: group size from the wire], qualify/evidence/checks.py):
the group size the bytes carry, per rank and process group, against the requested one;
a group size the subject reports is compared too, and never stands in for the wire."""

from __future__ import annotations

import pytest

from qwz.qualify.evidence import checks
from qwz.qualify.evidence.schema import WireGroup

from ..records import CANDIDATE, make_payload, make_record, wire_group

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
        fewest, most = checks.wire_bounds(group, group_size)
        assert fewest <= sent <= most, (group_size, fewest, sent, most)
    # ... but groups of 64 never fit a request of 8192, nor groups of 8192 one of 64.
    sent_64 = 4_205 * 64 + 4 * 4_205 + 2 * 2_062
    assert sent_64 > checks.wire_bounds(group, 8192)[1]
    sent_8192 = 33 * 8192 + 4 * 33 + 2 * 2_062
    assert sent_8192 < checks.wire_bounds(group, 64)[0]


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
    alone = checks.wire_bounds(WireGroup(**rank_0), 64)
    assert not alone[0] <= 290_064 <= alone[1]  # judged alone, rank 0's row is too long
    probe["wire"] = [rank_0 | {"bytes_per_step": 274_592}, rank_1 | {"bytes_per_step": 274_592}]
    checked = {check.name: check for check in make_record(**payload).checks}
    assert checked[f"probe[{CANDIDATE}]"].status == "fail"  # groups of 8192 on that wire
