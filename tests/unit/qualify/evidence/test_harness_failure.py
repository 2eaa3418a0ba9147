"""A failure of the harness is never the subject's FAIL ([Note: harness errors] in
qwz/qualify/evidence/harness_error.py): which rank failures are the harness's, the
HARNESS-ERROR exit of ``run`` with what it needed and the subject's version and commit,
``bisect`` skipping such a commit, ``matrix`` keeping it as its own cell status.

The end-to-end test forces the seam to need an attribute no DeepSpeed has, through a
``sitecustomize`` every process of the run imports (the preflight reads the source
statically and passes: this is what only a rank can meet)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from qwz.qualify import cli
from qwz.qualify.base.rank_reports import RankEnd
from qwz.qualify.bisect import bisect_command, trial, worktrees
from qwz.qualify.evidence import harness_error
from qwz.qualify.evidence import record as records
from tests.unit.qualify.bisect.test_bisect import _history, _own_shard_broken
from tests.unit.qualify.matrix.test_cells import S2, FakeRun, rows, run
from tests.unit.records import make_record

WORKTREE = pathlib.Path(__file__).resolve().parents[4]
MISSING = "qwz_test_attribute_no_deepspeed_has"


def _end(how: str = "raised", error: str | None = None) -> RankEnd:
    return RankEnd(1, how, error, ("Traceback", "..."), None, None, {"arm": "reference"}, 0.0)


def test_only_the_seams_own_error_is_a_harness_error():
    assert harness_error.is_harness_error(_end(error="SeamError: the harness's seam needs X"))
    assert not harness_error.is_harness_error(_end(error="AttributeError: no attribute 'x'"))
    assert not harness_error.is_harness_error(_end(error="RuntimeError: SeamError: quoted"))
    assert not harness_error.is_harness_error(_end(how="signal"))


def _content(sha: str | None = "0123456789abcdef", needed: str = "needs X") -> dict:
    return {
        "verdict": harness_error.HARNESS_ERROR,
        "needed": needed,
        "rank": 1,
        "subject": {"name": "deepspeed-native", "version": "0.19.6", "sha": sha, "dirty": False},
    }


def test_the_summary_names_the_subject_version_and_commit():
    line = harness_error.summary(_content())
    assert line == (
        "HARNESS-ERROR: the harness could not observe deepspeed-native 0.19.6 at 0123456789ab "
        "(rank 1): needs X"
    )


def test_writing_the_error_removes_a_stale_verdict(tmp_path):
    (tmp_path / "record.json").write_text("{}")
    (tmp_path / "report.md").write_text("PASS")
    path = harness_error.write(tmp_path, _content())
    assert sorted(p.name for p in tmp_path.iterdir()) == [harness_error.FILE_NAME]
    assert harness_error.read_summary(tmp_path) == harness_error.summary(
        json.loads(path.read_text())
    )


# ------------------------------------------------------------------------------- matrix
def test_a_harness_error_cell_is_its_own_status_and_runs_again(tmp_path):
    class HarnessErrorRun(FakeRun):
        def __call__(self, argv, logs, stop):
            if argv[argv.index("--stage") + 1] != "2":
                return super().__call__(argv, logs, stop)
            self.launched.append(argv)
            out = pathlib.Path(argv[argv.index("--out") + 1])
            harness_error.write(out, _content())
            return harness_error.HARNESS_ERROR_EXIT

    assert run(tmp_path, HarnessErrorRun()) == harness_error.HARNESS_ERROR_EXIT
    cell = rows(tmp_path)[S2]
    assert (cell.status, cell.kind, cell.record) == ("HARNESS-ERROR", "harness-error", None)
    assert cell.reason == harness_error.summary(_content())
    again = FakeRun()
    assert run(tmp_path, again) == 0 and len(again.launched) == 1  # only that cell, now PASS


def test_a_harness_error_exit_without_its_file_is_a_crash(tmp_path):
    assert run(tmp_path, FakeRun({"2": (4, "", None)})) == 1
    assert rows(tmp_path)[S2].status == "crashed"


def test_a_fail_outweighs_a_harness_error():
    from qwz.qualify.review import matrix as table

    def cell(status, kind):
        return table.MatrixCell(
            id=status, group="g", axes={}, status=status, kind=kind, reason="",
            arguments=[], record=None, digest=None, wall_s=None,
        )  # fmt: skip

    harness = cell("HARNESS-ERROR", "harness-error")
    assert table.status_of([cell("PASS", "ran"), harness]) == harness_error.HARNESS_ERROR_EXIT
    assert table.status_of([cell("FAIL", "ran"), harness]) == 1


# ------------------------------------------------------------------------------- bisect
def test_bisect_skips_a_commit_the_harness_cannot_observe(monkeypatch, tmp_path):
    """The real trial (trial.run_trial), its ``run`` replaced by what each commit does."""
    repository = tmp_path / "repo"
    behaviours = ["good", "good", "harness", "good", "bad", "bad"]
    shas = _history(repository, behaviours)
    behaviour_of = dict(zip(shas, behaviours, strict=True))

    def fake_run(argv, cwd, env, log):
        out = pathlib.Path(argv[argv.index("--out") + 1])
        log.write_text("run output\n")
        behaviour = behaviour_of[env["QWZ_BISECT_COMMIT"]]
        if behaviour == "harness":
            harness_error.write(out, _content(sha=env["QWZ_BISECT_COMMIT"]))
            return harness_error.HARNESS_ERROR_EXIT
        built = make_record() if behaviour == "good" else _own_shard_broken()
        records.save(built, out / "record.json")
        return 0 if behaviour == "good" else 1

    monkeypatch.setattr(trial, "_prepare", lambda request, out, sha, attempt: (tmp_path, []))
    monkeypatch.setattr(trial, "_run_logged", fake_run)
    monkeypatch.setattr(worktrees, "remove", lambda repository, worktree: None)
    argv = ["bisect", "--repo", str(repository), "--good", shas[0], "--bad", shas[-1],
            "--out", str(tmp_path / "out"), "--", "--workload", "mlp"]  # fmt: skip
    assert cli.main(argv) == bisect_command.FOUND
    result = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert result["first_bad"]["sha"] == shas[4]
    [skipped] = [item for item in result["tested"] if item["sha"] == shas[2]]
    [attempt] = skipped["attempts"]
    assert attempt["verdict"] == "skip" and attempt["exit_code"] == 4
    assert attempt["why"].startswith("HARNESS-ERROR: the harness could not observe")


# ------------------------------------------------------------------------------- run
SITECUSTOMIZE = f"""
from qwz.integrations.deepspeed import shards
shards.NEEDED = (*shards.NEEDED, {MISSING!r})
"""


@pytest.mark.multigpu
@pytest.mark.slow
def test_a_seam_that_cannot_observe_ends_harness_error_not_fail(tmp_path):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    from qwz.integrations.deepspeed.structure import real_version

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(shim), str(WORKTREE)]),
        DS_ACCELERATOR="cpu",
        QWZ_BACKEND="gloo",
    )
    done = subprocess.run(
        [sys.executable, "-m", "qwz.qualify", "run", "--out", str(out),
         "--subject", "deepspeed-native", "--workload", "mlp", "--steps", "2", "--blocks", "1",
         "--block-steps", "1", "--warmup-steps", "1", "--world-size", "2", "--kernels", "eager"],
        capture_output=True, text=True, cwd=WORKTREE, env=env, timeout=1200, check=False,
    )  # fmt: skip
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == harness_error.HARNESS_ERROR_EXIT, said
    assert not (out / "record.json").exists()  # nothing judged the subject
    content = json.loads((out / harness_error.FILE_NAME).read_text())
    assert content["verdict"] == "HARNESS-ERROR"
    assert f"DeepSpeedZeroOptimizer.{MISSING}" in content["needed"]
    import deepspeed

    package = pathlib.Path(deepspeed.__file__).resolve().parent
    version = real_version(package, deepspeed.__version__)
    assert content["subject"]["version"] == version and f"DeepSpeed {version}" in content["needed"]
    assert "HARNESS-ERROR: the harness could not observe deepspeed-native" in done.stdout


# ------------------------------------------------------------------------------- crash records
def test_a_crash_record_is_judged_at_the_ranks_world_size_not_the_launchers():
    """The launcher writes a crash record outside any process group: judged as one rank it
    said "one rank: nothing was quantized or sent" of arms that ran on two."""
    from qwz.qualify.base.plan import RunPlan
    from qwz.qualify.evidence import build as evidence
    from qwz.qualify.run.workloads import get_workload

    where = {"phase": "train", "arm": "reference", "step": 1, "last_completed_step": 0}
    crashed = evidence.build_failure_record(
        RunPlan(workload=get_workload("mlp"), steps=6, blocks=0),
        2,
        _end(error="RuntimeError: boom")._replace(where=where),
    )
    assert crashed.environment.world_size == 2
    said = "; ".join(check.detail for check in crashed.checks)
    assert "one rank" not in said, said


def test_ranks_that_imported_different_deepspeeds_are_a_harness_error():
    from qwz.qualify.run import runner
    from qwz.qualify.run.subjects import DeepSpeedSourceError

    same = [{"rank": r, "deepspeed": "DeepSpeed 0.19.6 at abc from /ds"} for r in (0, 1)]
    runner._same_deepspeed_everywhere(same)
    other = [same[0], {"rank": 1, "deepspeed": "DeepSpeed 0.19.8 (not a git checkout) from /v"}]
    with pytest.raises(DeepSpeedSourceError, match=r"rank 1: DeepSpeed 0\.19\.8") as caught:
        runner._same_deepspeed_everywhere(other)
    error = f"{type(caught.value).__name__}: {caught.value}"
    assert harness_error.is_harness_error(_end(error=error))
