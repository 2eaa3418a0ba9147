"""The checks and verdict derived from raw observations: ``qwz/qualify/evidence/checks.py``.

Each test changes the observations of the synthetic record the way a broken or
degenerate run would, and asserts the check that must react and its status.
"""

from __future__ import annotations

import copy

import pytest

from qwz.qualify.evidence.rules import learning, speed
from tests.unit.records import (
    CALIBRATION,
    CANDIDATE,
    EVAL_STEPS,
    REFERENCE,
    make_payload,
    make_record,
    non_finite_failure,
)


def by_name(record):
    return {check.name: check for check in record.checks}


def held_out(payload, arm, losses):
    trajectory = next(t for t in payload["trajectories"] if t["arm"] == arm)
    trajectory["held_out"] = [
        {"step": step, "loss": loss} for step, loss in zip(EVAL_STEPS, losses, strict=True)
    ]


def test_the_synthetic_record_passes_with_evidence_everywhere():
    record = make_record()
    assert record.verdict.status == "PASS"
    assert record.verdict.not_applicable == []
    assert set(record.verdict.evidence) == {check.name for check in record.checks}


def test_the_reference_not_learning_makes_the_run_inconclusive():
    payload = make_payload()
    flat = [7.6728, 7.6701, 7.6690, 7.6712, 7.6695]  # falls 0.04%: below 2%
    for arm in (REFERENCE, CALIBRATION, CANDIDATE):
        held_out(payload, arm, flat)
    record = make_record(trajectories=payload["trajectories"])
    assert record.verdict.status == "INCONCLUSIVE" and not record.verdict.passed
    assert record.verdict.failed == []
    assert record.verdict.inconclusive == [f"learning[{REFERENCE}]", f"learning[{CANDIDATE}]"]
    assert "did not learn" in by_name(record)[f"learning[{REFERENCE}]"].detail


def test_a_candidate_that_does_not_learn_fails_learning():
    payload = make_payload()
    held_out(payload, CANDIDATE, [7.6728, 7.60, 7.55, 7.51, 7.48])
    record = make_record(trajectories=payload["trajectories"])
    check = by_name(record)[f"learning[{CANDIDATE}]"]
    assert check.status == "fail" and record.verdict.failed == [f"learning[{CANDIDATE}]"]
    assert check.numbers["worst_step"] == 20


def test_the_margin_is_calibrated_from_the_noise_arm():
    record = make_record()
    numbers = learning.learning_margin(record)
    # Reference drop 7.6728 - 5.8716; calibration's largest gap |6.7213 - 6.7207|.
    assert numbers["reference_drop"] == pytest.approx(1.8012)
    assert numbers["noise_gap"] == pytest.approx(0.0006)
    assert numbers["margin"] == pytest.approx(
        max(learning.MARGIN_FACTOR * 0.0006, learning.MARGIN_FLOOR * 1.8012)
    )
    # A noisier calibration widens the margin: a candidate just inside it passes.
    payload = make_payload()
    held_out(payload, CALIBRATION, [7.6728, 7.0256, 6.7207 + 0.2, 6.3191, 5.8716])
    held_out(payload, CANDIDATE, [7.6728, 7.0256, 6.7207, 6.3191, 5.8716 + 0.55])
    noisy = make_record(trajectories=payload["trajectories"])
    assert learning.learning_margin(noisy)["margin"] == pytest.approx(0.6)
    assert by_name(noisy)[f"learning[{CANDIDATE}]"].status == "pass"


def test_a_diverged_arm_fails_finite_naming_step_rank_and_parameters():
    payload = make_payload()
    candidate = payload["trajectories"][2]
    candidate["losses"] = candidate["losses"][:6]
    candidate["grad_norms"] = candidate["grad_norms"][:6]
    candidate["held_out"] = candidate["held_out"][:2]
    candidate["failure"] = non_finite_failure(
        7, 1, "NonFiniteError: step 7: non-finite gradient (norm inf)"
    )
    record = make_record(trajectories=payload["trajectories"])
    check = by_name(record)[f"finite[{CANDIDATE}]"]
    assert check.status == "fail"
    assert "step 7 on rank 1" in check.detail and "lm_head.weight" in check.detail
    assert by_name(record)[f"learning[{CANDIDATE}]"].status == "fail"


def test_step_one_masters_that_differ_fail_naming_the_parameters():
    payload = make_payload()
    payload["step_one"][2]["digests"]["lm_head.weight"] = "0" * 16
    record = make_record(step_one=payload["step_one"])
    check = by_name(record)[f"step1-exact[{CANDIDATE}]"]
    assert check.status == "fail" and "lm_head.weight" in check.detail


def test_step_one_is_not_applicable_when_an_arm_never_got_there():
    payload = make_payload()
    payload["step_one"][0]["digests"] = None
    record = make_record(step_one=payload["step_one"])
    assert by_name(record)[f"step1-exact[{CANDIDATE}]"].status == "n/a"


def test_one_rank_has_no_replicas_and_no_wire():
    payload = make_payload(environment={"world_size": 1, "device_names": ["NVIDIA H200"]})
    for hashes in payload["hashes"]:
        hashes["per_rank"] = hashes["per_rank"][:1]
    # qwz's engine gathers a one-rank group exactly and reports no group size.
    payload["probes"][0] |= {"reported_group_sizes": [None], "gather_bytes_per_step": 0,
                             "reference_gather_bytes_per_step": 0}  # fmt: skip
    record = make_record(**payload)
    names = by_name(record)
    assert names[f"probe[{CANDIDATE}]"].status == "n/a"
    reporting = copy.deepcopy(payload)
    reporting["probes"][0]["reported_group_sizes"] = [64]
    assert by_name(make_record(**reporting))[f"probe[{CANDIDATE}]"].status == "fail"
    # The DeepSpeed drop-in gathers one rank exactly as well: a reported size is a failure.
    reporting["subject"] = {"name": "deepspeed", "version": "0.19.8", "sha": None}
    assert by_name(make_record(**reporting))[f"probe[{CANDIDATE}]"].status == "fail"
    # [Note: one rank]: nothing was quantized or sent, so nothing vacuous passes.
    assert names[f"in-effect[{CANDIDATE}]"].status == "inconclusive"
    assert "nothing was quantized or sent" in names[f"in-effect[{CANDIDATE}]"].detail
    assert names[f"replicas[{CANDIDATE}]"].status == "n/a"
    assert record.verdict.status == "INCONCLUSIVE"
    assert names[f"bounded[{CANDIDATE}]"].status == "inconclusive"
    assert record.verdict.inconclusive == [f"in-effect[{CANDIDATE}]", f"bounded[{CANDIDATE}]"]
    assert f"in-effect[{CANDIDATE}]" not in record.verdict.evidence


def test_a_gather_that_sends_nothing_on_two_ranks_fails_in_effect():
    payload = make_payload()
    payload["probes"][0]["gather_bytes_per_step"] = 0
    assert by_name(make_record(probes=payload["probes"]))[f"in-effect[{CANDIDATE}]"].status == (
        "fail"
    )


def test_replicas_that_diverge_name_the_step():
    payload = make_payload()
    payload["hashes"][2]["divergence"] = {"step": 3, "parameters": ["model.norm.weight"]}
    check = by_name(make_record(hashes=payload["hashes"]))[f"replicas[{CANDIDATE}]"]
    assert check.status == "fail" and "after step 3" in check.detail


@pytest.mark.parametrize(
    "status, expected", [("recorded", "n/a"), ("not-checked", "n/a"), ("mismatch", "fail")]
)
def test_reproduction_without_an_earlier_run_is_not_a_pass(status, expected):
    payload = make_payload()
    payload["hashes"][2]["ledger_status"] = status
    check = by_name(make_record(hashes=payload["hashes"]))[f"reproduced[{CANDIDATE}]"]
    assert check.status == expected


def test_an_own_shard_violation_names_where():
    payload = make_payload()
    payload["own_shards"][1] = {
        "arm": CANDIDATE,
        "max_ratio": 2.09,
        "first_violation": {
            "step": 1,
            "rank": 0,
            "parameter": "lm_head.weight",
            "index": 5,
            "what": "",
            "ratio": 2.09,
        },
    }
    check = by_name(make_record(own_shards=payload["own_shards"]))[f"own-shard[{CANDIDATE}]"]
    assert check.status == "fail" and "step 1, rank 0, lm_head.weight[5]" in check.detail


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_too_few_blocks_give_no_interval(blocks):
    raw = copy.deepcopy(
        [
            {"order": "AB", "reference_times_s": [0.04, 0.041], "candidate_times_s": [0.04, 0.04]},
            {"order": "BA", "reference_times_s": [0.04, 0.042], "candidate_times_s": [0.04, 0.04]},
        ]
        * 2
    )[:blocks]
    summary = speed.summarize_blocks(raw)
    assert summary["interval"] == "insufficient blocks"
    assert summary["median_speedup"] is None and summary["ci_low"] is None
    payload = make_payload(plan={"min_speedup": 1.0})
    payload["performance"][0] |= summary
    record = make_record(performance=payload["performance"], plan=payload["plan"])
    check = by_name(record)[f"speedup[{CANDIDATE}]"]
    assert check.status == "n/a" and "insufficient blocks" in check.detail


def test_a_speed_requirement_is_judged_on_the_interval():
    record = make_record(plan={"min_speedup": 1.05})
    assert by_name(record)[f"speedup[{CANDIDATE}]"].status == "fail"
    record = make_record(plan={"min_speedup": 1.0})
    assert by_name(record)[f"speedup[{CANDIDATE}]"].status == "pass"


def test_a_crashed_run_is_a_fail_record_naming_the_rank_arm_and_step(tmp_path):
    """The launcher's report of the rank that failed first becomes a record (the CLI writes
    it): the arm it crashed in names the rank, the signal and the last completed step, the
    arms after it are "not run" (not failures), and it loads, reports and compares like any
    other."""
    from qwz.qualify.base.plan import RunPlan
    from qwz.qualify.base.rank_reports import RankEnd
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.evidence import record
    from qwz.qualify.review import report
    from qwz.qualify.run.workloads import get_workload

    where = {"phase": "train", "arm": "reference", "step": 4, "last_completed_step": 3}
    killed = RankEnd(1, "signal", "killed by SIGKILL", (), "SIGKILL", -9, where, 10.0)
    reset = RankEnd(
        0, "raised", "RuntimeError: Connection reset by peer", ("Traceback",), None, None,
        where, 9.5,
    )  # fmt: skip
    plan = RunPlan(workload=get_workload("mlp"), steps=6, blocks=0)
    crashed = evidence.build_failure_record(plan, 2, killed, (reset,))
    assert crashed.verdict.status == "FAIL"
    assert crashed.verdict.failed == ["finite[reference]"]
    failure = crashed.trajectories[0].failure
    assert (failure.kind, failure.rank, failure.ranks, failure.step) == ("crash", 1, [1], 4)
    assert (failure.signal, failure.last_completed_step, failure.phase) == ("SIGKILL", 3, "train")
    assert failure.context == ["rank 0 raised RuntimeError: Connection reset by peer"]
    for trajectory in crashed.trajectories[1:]:
        assert trajectory.failure.kind == "not-run", trajectory.arm
        assert f"finite[{trajectory.arm}]: not run: the run ended in reference" in "; ".join(
            crashed.verdict.not_applicable
        )
    path = tmp_path / "record.json"
    record.save(crashed, path)
    loaded = record.load(path)
    text = report.render_markdown(loaded)
    assert "| `reference` | 4 | 1 | crash |" in text
    assert "crashed on rank 1: phase train; last completed step 3; signal SIGKILL" in text
    assert "Not run (the run ended before they started): `calibration-g64`, `candidate-g64`" in text


def test_a_wrong_global_norm_fails_update_naming_it():
    payload = make_payload()
    payload["updates"][2] |= {
        "norm_violations": 20,
        "norm_max_ratio": 4.1e3,
        "first_violation": {
            "step": 1,
            "rank": 0,
            "parameter": "(global gradient norm)",
            "index": -1,
            "what": "the optimizer was handed a gradient of global norm 1.34393",
            "ratio": 4.1e3,
        },
    }
    check = by_name(make_record(updates=payload["updates"]))[f"update[{CANDIDATE}]"]
    assert check.status == "fail"
    assert "global norm of the gradient the optimizer was handed was wrong on 20" in check.detail
    assert "(global gradient norm)" in check.detail


def test_own_shard_mismatches_fail_and_kernel_fallbacks_are_named():
    payload = make_payload()
    fallback = "native kernels dropped, torch.compile instead: RuntimeError: native kernels"
    kernels = [{"rank": r, "kernels": "fused", "native": False, "fallbacks": [fallback]}
               for r in (0, 1)]  # fmt: skip
    payload["own_shards"][1] |= {"mismatches": 7, "kernels": kernels}
    check = by_name(make_record(own_shards=payload["own_shards"]))[f"own-shard[{CANDIDATE}]"]
    assert check.status == "fail" and check.detail.startswith("7 of 81920 own-shard elements")
    assert fallback in check.detail
    # The same fallback on a candidate that matches the spec is shown, and passes.
    payload["own_shards"][1]["mismatches"] = 0
    check = by_name(make_record(own_shards=payload["own_shards"]))[f"own-shard[{CANDIDATE}]"]
    assert check.status == "pass" and fallback in check.detail


def test_an_own_shard_that_saw_nothing_is_not_a_pass():
    payload = make_payload()
    payload["own_shards"][1]["checked"] = 0
    check = by_name(make_record(own_shards=payload["own_shards"]))[f"own-shard[{CANDIDATE}]"]
    assert check.status == "n/a"
