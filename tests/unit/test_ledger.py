"""The hash ledger (qwz/qualify/ledger.py): what a run is compared with."""

from __future__ import annotations

from qwz.qualify import ledger

WORKLOAD = {"name": "mlp", "params": {}, "steps": 8, "seed": 0, "subject": "qwz"}
ARMS = {
    "reference": {"name": "reference", "quantized": False, "group_size": None},
    "calibration-g64": {"name": "calibration-g64", "quantized": False, "group_size": None},
    "candidate-g64": {"name": "candidate-g64", "quantized": True, "group_size": 64},
}


def record(directory, arm: str, final_hash: str, head: str = "a" * 40):
    return ledger.check_and_record(
        directory,
        head_sha=head,
        fingerprint="env",
        workload=WORKLOAD,
        arm=ARMS[arm],
        final_hash=final_hash,
    )


def test_arms_that_send_alike_are_told_apart_as_siblings(tmp_path):
    """The reference and the calibration arm are both unquantized: each keeps its own entry
    among the candidate's siblings, named, whatever order the ledger files sort in."""
    record(tmp_path, "reference", "1" * 64)
    record(tmp_path, "calibration-g64", "2" * 64)
    result = record(tmp_path, "candidate-g64", "3" * 64)
    assert result.status == "recorded"
    assert result.siblings == {
        "reference (unquantized)": "1" * 64,
        "calibration-g64 (unquantized)": "2" * 64,
    }


def test_a_second_run_reproduces_or_reports_the_mismatch(tmp_path):
    assert record(tmp_path, "candidate-g64", "3" * 64).status == "recorded"
    assert record(tmp_path, "candidate-g64", "3" * 64).status == "reproduced"
    mismatch = record(tmp_path, "candidate-g64", "4" * 64)
    assert mismatch.status == "mismatch" and mismatch.previous == "3" * 64
    assert record(tmp_path, "candidate-g64", "3" * 64, head="b" * 40).status == "recorded"
