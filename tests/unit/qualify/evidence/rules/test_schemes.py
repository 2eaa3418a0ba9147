"""``own-shard`` under the contract's schemes ([Note: one scheme per run],
qwz/qualify/evidence/contract.py): the scheme a run used is named, a run that mixes two FAILs
naming both, a weight beyond fp16's range under DeepSpeed's scheme FAILs as what it is, and the
reviewer's sentence says what the scheme cost."""

from __future__ import annotations

from qwz.qualify.evidence.contract import ABSMAX_127, ZEROPP
from qwz.qualify.evidence.rules import schemes
from qwz.qualify.evidence.schema import OwnShards, SchemeCost
from tests.unit.records import CANDIDATE, make_payload, make_record


def _own(**fields) -> OwnShards:
    base = {"arm": CANDIDATE, "max_ratio": 1.9, "first_violation": None, "checked": 4096}
    return OwnShards.model_validate(base | fields)


def _run(*arms: tuple[str, set[str]]) -> schemes.RunScheme:
    return schemes.RunScheme({arm: frozenset(found) for arm, found in arms})


ZEROPP_RANKS = {"scheme_by_rank": [ZEROPP, ZEROPP], "by_scheme": {ZEROPP: 4096}, "reference": 4000}


def test_a_zeropp_run_passes_naming_its_scheme():
    own = _own(**ZEROPP_RANKS, near_ties=96)
    check = schemes.own_shard(own, True, None, _run((CANDIDATE, {ZEROPP})))
    assert check.status == "pass" and check.numbers["scheme"] == ZEROPP
    assert "DeepSpeed's ZeRO++ quantizer on every rank" in check.detail
    assert "4000 bit for bit the reference" in check.detail


def test_two_schemes_on_two_ranks_fail_naming_both():
    own = _own(scheme_by_rank=[ABSMAX_127, ZEROPP], by_scheme={ABSMAX_127: 2048, ZEROPP: 2048})
    run = _run((CANDIDATE, schemes.arm_schemes(own)))
    check = schemes.own_shard(own, True, None, run)
    assert check.status == "fail" and check.numbers["schemes"] == [ABSMAX_127, ZEROPP]
    assert (
        "mixes the contract's schemes" in check.detail
        and "absmax/127 and DeepSpeed" in check.detail
    )


def test_two_schemes_on_two_arms_fail_each_arm():
    run = _run((CANDIDATE, {ZEROPP}), ("candidate-g8192", {ABSMAX_127}))
    check = schemes.own_shard(_own(**ZEROPP_RANKS), True, None, run)
    assert check.status == "fail" and "candidate-g8192: absmax/127" in check.detail


def test_an_fp16_overflow_fails_as_what_it_is():
    own = _own(**ZEROPP_RANKS, fp16_overflow=64)
    check = schemes.own_shard(own, True, None, _run((CANDIDATE, {ZEROPP})))
    assert check.status == "fail" and check.numbers == {"fp16_overflow": 64}
    assert "beyond fp16's range" in check.detail and "decodes to NaN" in check.detail


def test_an_overflow_fails_even_where_its_nan_ended_the_arm():
    own = _own(**ZEROPP_RANKS, fp16_overflow=64, mismatches=3)
    check = schemes.own_shard(own, True, {"kind": "non-finite"}, _run((CANDIDATE, {ZEROPP})))
    assert check.status == "fail" and check.numbers == {"fp16_overflow": 64}


def test_the_unquantized_reference_is_judged_as_the_cast():
    check = schemes.own_shard(_own(arm="reference"), False, None, _run())
    assert check.status == "pass" and "its fp32 master cast" in check.detail


def test_the_reviewers_sentence_names_the_scheme_its_clip_and_its_cost():
    payload = make_payload()
    candidate = payload["own_shards"][1]
    candidate |= {"scheme_by_rank": [ZEROPP, ZEROPP], "by_scheme": {ZEROPP: 81_920}}
    candidate["cost"] |= {"written_worst": 0.0078125, "fp16_below_normal": 3}
    report = schemes.scheme_report(make_record(own_shards=payload["own_shards"]))
    assert report.scheme == ZEROPP and not report.mixed and report.arm == CANDIDATE
    sentence = report.sentence("the loss gap is +0.001 against a margin of 0.005")
    assert "DeepSpeed's ZeRO++ quantizer" in sentence and "127/128" in sentence
    assert "worst 0.781% / mean 0.0985% of the group's absmax" in sentence
    assert "absmax/127's 0.394%" in sentence and "bfloat16 cast's 0.195%" in sentence
    assert "fp16 staging changes 3 inputs" in sentence and sentence.endswith("margin of 0.005")


def test_a_cost_with_a_non_finite_weight_says_so():
    cost = SchemeCost.model_validate(
        {"elements": 1, "written_worst": None, "written_mean": None, "absmax127_worst": 0.0,
         "absmax127_mean": 0.0, "cast_worst": 0.0, "cast_mean": 0.0, "cast_dtype": "bfloat16",
         "fp16_below_normal": 0, "fp16_overflow": 1}
    )  # fmt: skip
    assert "worst n/a" in schemes.cost_sentence(cost)
