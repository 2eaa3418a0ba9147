"""The claims table of a PR review (qwz/qualify/review/claims.py, [Note: claims and their
checks]) from records made by tests/unit/records.py: a DeepSpeed-native head with the PR's two
candidates (G = 64 with the key left out, G = 8192 written) and a base of the reference alone."""

from __future__ import annotations

import copy

import pytest

from qwz.qualify.evidence import checks, seal
from qwz.qualify.evidence.default_path import compare_default_path
from qwz.qualify.evidence.rules import RULES
from qwz.qualify.evidence.schema import Check
from qwz.qualify.review import claims
from qwz.qualify.review.claims import (
    CLAIMS,
    FAIL,
    INCONCLUSIVE,
    NOT_IN_RECORD,
    NOT_JUDGED,
    PASS,
    claims_table,
)
from tests.unit.records import (
    CALIBRATION,
    CANDIDATE,
    conformance_table,
    make_payload,
    make_performance,
    wire_group,
)

G8192 = "candidate-g8192"
NATIVE = {"name": "deepspeed-native", "version": "0.19.8", "sha": "ab" * 20, "dirty": False}


def _renamed(item: dict) -> dict:
    return dict(item, arm=G8192) if item.get("arm") == CALIBRATION else item


def head_payload() -> dict:
    """The head of a PR: reference, candidate-g64 (key omitted), candidate-g8192 (the
    calibration arm of records.py made a candidate of G = 8192)."""
    data = make_payload(subject=NATIVE)
    data["conformance"] = conformance_table("deepspeed-native-proposal")
    for section in ("trajectories", "step_one", "updates", "hashes", "drift", "memory"):
        data[section] = [_renamed(item) for item in data[section]]
    for arm in data["arms"]:
        zero = arm["config"]["zero_optimization"]
        if arm["name"] == CANDIDATE:
            zero.pop("zero_quantized_weights_group_size")  # what review runs for the default
        if arm["name"] == CALIBRATION:
            config = copy.deepcopy(next(a for a in data["arms"] if a["quantized"])["config"])
            config["zero_optimization"]["zero_quantized_weights_group_size"] = 8192
            arm.update(name=G8192, role="candidate", quantized=True, group_size=8192)
            arm["config"] = config
    data["learning"] = dict(data["learning"], calibration_arm=None, calibration_group_size=None)
    own = next(item for item in data["own_shards"] if item["arm"] == CANDIDATE)
    data["own_shards"].append(dict(own, arm=G8192))
    probe = data["probes"][0]
    data["probes"].append(
        dict(
            probe,
            arm=G8192,
            requested_group_size=8192,
            reported_group_sizes=[8192, 8192],
            gather_bytes_per_step=579_548,  # 579,264 codes + 4 B for each of 71 groups
            wire=[wire_group(rank, 579_548) for rank in (0, 1)],
        )
    )
    data["performance"].append(dict(make_performance(0.97), arm=G8192))
    return data


def base_payload() -> dict:
    """The base: the reference alone, its A/A speed blocks."""
    data = make_payload(subject=NATIVE)
    data["arms"] = [arm for arm in data["arms"] if arm["name"] == "reference"]
    for section in ("trajectories", "step_one", "updates", "hashes", "own_shards", "memory"):
        data[section] = [item for item in data[section] if item["arm"] == "reference"]
    data["drift"], data["probes"] = [], []
    data["learning"] = dict(data["learning"], calibration_arm=None, calibration_group_size=None)
    data["performance"] = [dict(make_performance(), arm="reference")]
    return data


def table(head: dict | None = None, base: dict | None = None) -> dict[str, claims.ClaimRow]:
    head_record = seal.seal(head or head_payload())
    base_record = seal.seal(base or base_payload())
    default_path = compare_default_path(base_record, head_record)
    return {row.claim: row for row in claims_table(head_record, base_record, default_path)}


def test_a_passing_head_decides_every_claim_it_has_the_checks_for():
    rows = table()
    assert [row.claim for row in rows.values()] == [claim.claim for claim in CLAIMS]
    honour = rows["ZeRO-1/2 honour zero_quantized_weights"]
    assert honour.verdict == PASS
    assert honour.checks == (f"in-effect[{CANDIDATE}]", f"in-effect[{G8192}]")
    default = rows["64-element symmetric int8 groups; default 64"]
    assert default.verdict == PASS and default.checks == (f"probe[{CANDIDATE}]", "conformance")
    assert "conformance row stage1-omitted (accept, accepted): pass" in default.detail
    for claim in (
        "group sizes: positive multiples of 8",
        "non-default group size rejected with ZeRO-3",
        "FP32 and ZenFlow rejected with quantized weights",
    ):
        assert rows[claim].verdict == PASS and rows[claim].checks == ("conformance",), claim
    forwarded = rows["group size forwarded through engine and optimizer"]
    assert forwarded.verdict == PASS and forwarded.checks == (f"probe[{G8192}]",)
    assert rows["small parameters exact"].checks == (
        f"own-shard[{CANDIDATE}]",
        f"own-shard[{G8192}]",
    )
    scheme = rows[claims.SCHEME_CLAIM]
    assert scheme.verdict == PASS and scheme.checks == rows["small parameters exact"].checks
    assert scheme.detail.startswith("the subject quantizes with absmax/127")
    assert "its decode error is worst 0.394%" in scheme.detail
    bounded = rows[claims.BOUNDED_CLAIM]
    assert bounded.verdict == PASS
    assert f"{CANDIDATE}: largest collective " in bounded.detail
    assert "; gather memory 98,816 B of " in bounded.detail
    replicas = rows["replicas identical"]
    assert replicas.verdict == PASS and len(replicas.checks) == 3  # every arm
    path = rows["default path unchanged"]
    # records.py's payloads keep no per-step masters: what was compared is equal, not all.
    assert path.verdict == INCONCLUSIVE and "not compared: masters" in path.detail
    speed = rows["speed-up [interval]"]
    assert speed.verdict == NOT_JUDGED and "(no --min-speedup)" in speed.detail
    assert f"{CANDIDATE} 1.037x [" in speed.detail
    assert "base reference 41.57 ms/step (its own run, another process: context only)" in (
        speed.detail
    )


def test_the_scheme_row_names_deepspeeds_scheme_and_fails_with_own_shard():
    payload = make_payload()
    candidate = payload["own_shards"][1]
    candidate |= {"scheme_by_rank": ["zeropp", "zeropp"], "by_scheme": {"zeropp": 81_920}}
    head = seal.seal(payload)
    row = {row.claim: row for row in claims_table(head, None, None)}[claims.SCHEME_CLAIM]
    assert row.verdict == PASS and "DeepSpeed's ZeRO++ quantizer" in row.detail
    assert "127/128 of itself" in row.detail
    payload["subject"] = dict(payload["subject"], substituted_ops=["the quantizer ran on CPU"])
    substituted = {row.claim: row for row in claims_table(seal.seal(payload), None, None)}
    assert substituted[claims.SCHEME_CLAIM].detail.startswith("the quantizer ran on CPU; ")
    candidate |= {"scheme_by_rank": ["absmax/127", "zeropp"]}
    mixed = seal.seal(payload)
    row = {row.claim: row for row in claims_table(mixed, None, None)}[claims.SCHEME_CLAIM]
    assert row.verdict == FAIL and "mixes the contract's schemes" in row.detail


def test_a_claim_whose_checks_a_record_lacks_is_not_in_this_record(monkeypatch):
    """A record of a harness that predates a check (as every record before the bounded and
    conformance checks): the claim is "not in this record", never a verdict."""
    later = claims.Claim("a later claim", (claims.Decider("a-later-check"),))
    monkeypatch.setattr(claims, "CLAIMS", (*CLAIMS, later))
    row = table()["a later claim"]
    assert (row.verdict, row.checks) == (NOT_IN_RECORD, ("a-later-check[candidates]",))
    assert row.detail == "a-later-check[candidates]: no such check in the head's record"


def test_a_failing_check_fails_its_claim_with_its_detail():
    def not_in_effect(data):
        probe = next(item for item in data["probes"] if item["arm"] == G8192)
        probe["wire"] = [wire_group(rank, 1_158_528) for rank in (0, 1)]  # bf16 bytes
        probe["gather_bytes_per_step"] = 1_158_528

    data = head_payload()
    not_in_effect(data)
    rows = table(head=data)
    honour = rows["ZeRO-1/2 honour zero_quantized_weights"]
    assert honour.verdict == FAIL
    assert honour.detail.startswith(f"in-effect[{G8192}]: ")
    assert rows["group size forwarded through engine and optimizer"].verdict == FAIL
    assert rows["64-element symmetric int8 groups; default 64"].verdict == PASS  # other arm


def test_with_min_speedup_the_speed_up_is_judged():
    data = head_payload()
    data["plan"] = dict(data["plan"], min_speedup=1.02)
    row = table(head=data)["speed-up [interval]"]
    assert row.checks == (f"speedup[{CANDIDATE}]", f"speedup[{G8192}]")
    assert row.verdict == FAIL  # G8192: about 1.006x, below 1.02
    assert row.detail.startswith(f"speedup[{G8192}]")


def test_a_changed_default_path_fails_its_claim():
    data = head_payload()
    next(t for t in data["trajectories"] if t["arm"] == "reference")["losses"][2] += 1e-9
    row = table(head=data)["default path unchanged"]
    assert row.verdict == FAIL and row.detail.startswith("default-path: differs first at step 3")


def test_without_a_base_the_default_path_is_not_in_this_record():
    head = seal.seal(head_payload())
    rows = {row.claim: row for row in claims_table(head, None, None)}
    assert rows["default path unchanged"].verdict == NOT_IN_RECORD


def test_a_head_without_a_non_default_candidate_cannot_show_the_forwarding():
    data = head_payload()
    for section in ("arms",):
        data[section] = [item for item in data[section] if item["name"] != G8192]
    for section in ("trajectories", "step_one", "updates", "hashes", "drift", "memory"):
        data[section] = [item for item in data[section] if item["arm"] != G8192]
    for section in ("own_shards", "probes", "performance"):
        data[section] = [item for item in data[section] if item["arm"] != G8192]
    row = table(head=data)["group size forwarded through engine and optimizer"]
    assert row.verdict == NOT_IN_RECORD and row.checks == ("probe[non-default]",)


@pytest.mark.parametrize(
    ("verdict", "status"),
    [("pass", PASS), ("fail", FAIL), ("not observed", INCONCLUSIVE), ("open", "n/a")],
)
def test_a_conformance_row_decides_the_claims_of_its_pr_claim(monkeypatch, verdict, status):
    """The conformance check (issue 28) keeps its table's rows in ``numbers["rows"]``, each
    with the PR claim it tests and its verdict; a claim reads the rows of its PR claims."""
    rows = [
        {"row": "stage2-g12", "claim": "8513-multiple-of-8", "expected": "refuse",
         "observed": "accepted" if verdict == "fail" else "refused", "verdict": verdict},
        {"row": "stage3-g128", "claim": "8513-zero-3", "expected": "refuse",
         "observed": "refused", "verdict": "pass"},
    ]  # fmt: skip
    check = Check(name="conformance", status="pass", detail="", numbers={"rows": rows})
    record = seal.seal(head_payload())
    monkeypatch.setattr(claims, "selected", lambda record, decider: [check])
    found = claims._found_checks(record, claims._conformance("8513-multiple-of-8"))
    assert found.statuses == [status]
    assert found.lines == [f"conformance row stage2-g12 (refuse, {rows[0]['observed']}): {verdict}"]
    row = next(
        row
        for row in claims_table(record, None, None)
        if row.claim == "group sizes: positive multiples of 8"
    )
    assert row.verdict == (status if status != "n/a" else INCONCLUSIVE)


def test_every_check_family_the_claims_name_is_a_judge_rule():
    assert checks.derive  # the rules register when the checks are imported
    missing = claims.judged_families() - set(RULES)
    assert not missing, f"claims name families no rule derives: {sorted(missing)}"
