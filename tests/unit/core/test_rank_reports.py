"""[Note: the rank that failed first] (qwz/qualify/base/rank_reports.py): which rank a crash record
blames, and the side-channel files a rank writes for its launcher."""

from __future__ import annotations

import json

import pytest

from qwz.qualify.base import rank_reports
from qwz.qualify.base.rank_reports import RankEnd

WHERE = {"arm": "reference", "step": 3}


def end(rank: int, how: str, error: str | None, at_s: float) -> RankEnd:
    signal = "SIGKILL" if how == "signal" else None
    return RankEnd(rank, how, error, (), signal, None, WHERE, at_s)


def test_an_own_error_is_the_cause_even_when_a_lost_peer_reported_first():
    lost = end(0, "raised", "RuntimeError: Connection closed by peer [127.0.0.1]:1", 1.0)
    own = end(1, "raised", "torch.OutOfMemoryError: CUDA out of memory", 2.0)
    assert lost.peer_lost and not own.peer_lost
    assert rank_reports.first_failure([lost, own]) is own


def test_a_killed_rank_is_the_cause_of_its_peers_connection_resets():
    lost = end(0, "raised", "RuntimeError: Connection reset by peer", 1.0)
    killed = end(1, "signal", "killed by SIGKILL", 2.0)
    assert rank_reports.first_failure([lost, killed]) is killed


def test_between_own_errors_the_earliest_wins_then_the_lowest_rank():
    later = end(0, "raised", "ValueError: b", 2.0)
    earlier = end(3, "raised", "ValueError: a", 1.0)
    tie = end(2, "raised", "ValueError: c", 1.0)
    assert rank_reports.first_failure([later, earlier, tie]) is tie


def test_crash_without_peers_writes_the_report_and_reraises(tmp_path, monkeypatch):
    monkeypatch.setenv(rank_reports.REPORTS_ENV, str(tmp_path))
    rank_reports.report_progress(arm="candidate-g64", step=3, last_completed_step=2)
    with pytest.raises(ValueError, match="boom"):
        try:
            raise ValueError("boom")
        except ValueError as error:
            rank_reports.crash(error, arm="candidate-g64", step=3, last_completed_step=2)
    report = json.loads((tmp_path / "rank00000.failure.json").read_text())
    assert report["error"] == "ValueError: boom"
    assert report["where"]["last_completed_step"] == 2
    assert report["traceback"][-1] == "ValueError: boom"
    found = rank_reports.reported_failure(tmp_path, 0)
    assert found is not None and found.where["arm"] == "candidate-g64"


def test_a_result_key_must_be_a_plain_name(tmp_path, monkeypatch):
    monkeypatch.setenv(rank_reports.REPORTS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="must match"):
        rank_reports.report_result("../escape", 1)
    rank_reports.report_result("candidate-g64", {"losses": [1.0]})
    assert rank_reports.results(tmp_path, 2) == {0: {"candidate-g64": {"losses": [1.0]}}, 1: {}}


def _report(directory, rank: int, error: str, at_s: float) -> None:
    report = {"error": error, "traceback": [error], "where": WHERE, "at_s": at_s}
    (directory / f"rank{rank:05d}.failure.json").write_text(json.dumps(report))


def test_under_torchrun_a_silent_rank_is_unreported_and_an_own_error_still_wins(tmp_path):
    """[Note: a crash under torchrun] (qwz/qualify/run/torchrun.py): from the reports alone, a rank
    with none is "unreported" -- the cause of its peers' lost connections, never of an own
    error -- and it is not counted among the ranks that failed on their own."""
    from qwz.qualify.base.plan import RunPlan
    from qwz.qualify.evidence.build import _crash_failure
    from qwz.qualify.run.launch import torchrun_failure
    from qwz.qualify.run.workloads import get_workload

    _report(tmp_path, 1, "torch.OutOfMemoryError: CUDA out of memory", 2.0)
    failure = torchrun_failure(tmp_path, 3, "qualify_rank", grace_s=0)
    assert failure.cause.rank == 1 and failure.cause.how == "raised"
    assert [(end.rank, end.how) for end in failure.context] == [
        (0, "unreported"),
        (2, "unreported"),
    ]
    assert "rank 0 ended without a report" in str(failure)
    crash = _crash_failure(RunPlan(workload=get_workload("mlp")), failure.cause, failure.context)
    assert crash["ranks"] == [1]
    (tmp_path / "rank00001.failure.json").unlink()
    _report(tmp_path, 0, "RuntimeError: Connection closed by peer [127.0.0.1]:1", 1.0)
    failure = torchrun_failure(tmp_path, 2, "qualify_rank", grace_s=0)
    assert (failure.cause.rank, failure.cause.how) == (1, "unreported")


def test_one_claim_of_the_record_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv(rank_reports.REPORTS_ENV, raising=False)
    assert not rank_reports.claim("record")  # no reports directory: nobody writes
    monkeypatch.setenv(rank_reports.REPORTS_ENV, str(tmp_path))
    assert rank_reports.claim("record")
    assert not rank_reports.claim("record")
