"""The hash ledger (qwz/qualify/evidence/ledger.py): what a run is compared with."""

from __future__ import annotations

from qwz.qualify.evidence import ledger
from qwz.qualify.evidence.schema import Head, Subject

WORKLOAD = {"name": "mlp", "params": {}, "steps": 8, "seed": 0, "subject": "qwz"}
ARMS = {
    "reference": {"name": "reference", "quantized": False, "group_size": None},
    "calibration-g64": {"name": "calibration-g64", "quantized": False, "group_size": None},
    "candidate-g64": {"name": "candidate-g64", "quantized": True, "group_size": 64},
}


HARNESS = Head(repository="qwz", sha="c" * 40, dirty=False)


def deepspeed_code(sha: str, diff: str | None = None, where: str = "/somewhere") -> dict:
    """The code identity of a deepspeed-native run of DeepSpeed 0.19.8 at `sha` (with an
    uncommitted change whose digest is `diff`)."""
    dirty = diff is not None
    subject = Subject(
        name="deepspeed-native", version="0.19.8", sha=sha, dirty=dirty, diff_sha256=diff,
        import_path=f"{where}/DeepSpeed/deepspeed", installed_commit="1111111",
    )  # fmt: skip
    head = Head(repository="/somewhere/DeepSpeed", sha=sha, dirty=dirty, diff_sha256=diff)
    return ledger.code_identity(subject, head, HARNESS)


def qwz_code(sha: str) -> dict:
    head = Head(repository="qwz", sha=sha, dirty=False)
    return ledger.code_identity(Subject(name="qwz", version="0.1.0", sha=sha), head, head)


def record(directory, arm: str, final_hash: str, head: str = "a" * 40, code=None):
    return ledger.check_and_record(
        directory,
        code=code if code is not None else qwz_code(head),
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


def test_two_deepspeed_commits_of_one_version_are_kept_apart(tmp_path):
    """Same version string, same install-time commit, same environment: the live commits
    differ, so each has its own entry and neither reports the other's hash as a mismatch."""
    base, pull_request = deepspeed_code("1" * 40), deepspeed_code("2" * 40)
    assert record(tmp_path, "candidate-g64", "3" * 64, code=base).status == "recorded"
    assert record(tmp_path, "candidate-g64", "4" * 64, code=pull_request).status == "recorded"
    assert record(tmp_path, "candidate-g64", "3" * 64, code=base).status == "reproduced"
    assert record(tmp_path, "candidate-g64", "4" * 64, code=pull_request).status == "reproduced"
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_an_uncommitted_edit_is_other_code(tmp_path):
    """A dirty checkout of the same commit is a different key, and so is a different edit;
    the same edit again reproduces."""
    clean, edited = deepspeed_code("1" * 40), deepspeed_code("1" * 40, diff="d" * 64)
    other_edit = deepspeed_code("1" * 40, diff="e" * 64)
    assert record(tmp_path, "candidate-g64", "3" * 64, code=clean).status == "recorded"
    assert record(tmp_path, "candidate-g64", "4" * 64, code=edited).status == "recorded"
    assert record(tmp_path, "candidate-g64", "5" * 64, code=other_edit).status == "recorded"
    assert record(tmp_path, "candidate-g64", "4" * 64, code=edited).status == "reproduced"


def test_where_the_checkout_lies_is_not_part_of_the_key(tmp_path):
    """The same commit imported from two directories (two machines) is the same code."""
    here, there = deepspeed_code("1" * 40), deepspeed_code("1" * 40, where="/elsewhere")
    assert record(tmp_path, "candidate-g64", "3" * 64, code=here).status == "recorded"
    assert record(tmp_path, "candidate-g64", "3" * 64, code=there).status == "reproduced"
