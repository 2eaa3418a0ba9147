"""End to end: `python -m qwz.qualify run`, `report` and `compare`, as users and CI call them.

Small runs (the `mlp` workload, few steps and blocks) on 2 spawned ranks; the
runs share one ledger so the hash-reproduction check is exercised in order:
recorded, reproduced, then a doctored ledger entry that must be caught.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from qwz.qualify.evidence import record
from qwz.qualify.run.launch import pick_backend
from tests import warm_python

pytestmark = pytest.mark.multigpu

SMALL_RUN = [
    "--workload", "mlp", "--steps", "4", "--blocks", "2", "--block-steps", "2",
    "--warmup-steps", "1", "--world-size", "2", "--kernels", "eager",
]  # fmt: skip


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return warm_python.run(["-m", "qwz.qualify", *args], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Three runs of the same head: first (recorded), second (reproduced), third against a
    ledger whose entry for the candidate was doctored (mismatch)."""
    root = tmp_path_factory.mktemp("qualify")
    ledger = root / "ledger"
    outputs = {}
    for name in ("first", "second"):
        done = _cli("run", "--out", str(root / name), "--ledger", str(ledger), *SMALL_RUN)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs[name] = root / name
    for entry in ledger.glob("*.json"):
        data = json.loads(entry.read_text())
        if data["arm"]["quantized"]:
            data["final_hash"] = "0" * 64
            entry.write_text(json.dumps(data))
    done = _cli("run", "--out", str(root / "third"), "--ledger", str(ledger), *SMALL_RUN)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout
    outputs["third"] = root / "third"
    outputs["third_stderr"] = done.stderr
    outputs["ledger"] = ledger
    return outputs


def test_run_writes_record_report_and_plots(runs):
    out = runs["first"]
    for name in ("record.json", "report.md", "loss.png", "speedup.png"):
        assert (out / name).stat().st_size > 0, name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = record.load(out / "record.json")
    assert loaded.verdict.passed, loaded.verdict
    assert [arm.name for arm in loaded.arms] == [
        "reference", "calibration-g64", "candidate-g64", "candidate-g64-chunked"
    ]  # fmt: skip
    # The backend the launcher picked for 2 local ranks: NCCL on a host with 2 GPUs.
    assert loaded.environment.world_size == 2
    assert loaded.environment.backend == pick_backend(2)
    determinism = loaded.environment.determinism
    assert determinism is not None and determinism.deterministic_algorithms
    assert len(loaded.head.sha) == 40 or loaded.head.sha == "unknown"
    assert len(loaded.performance[0].blocks) == 2
    assert [block.order for block in loaded.performance[0].blocks] == ["AB", "BA"]
    # Two blocks are too few for an interval: the record says so instead of inventing one.
    assert loaded.performance[0].interval == "insufficient blocks"
    assert loaded.performance[0].median_speedup is None
    report = (out / "report.md").read_text()
    assert "PASS" in report and "candidate-g64" in report


def test_rank0_shows_progress_and_other_ranks_stay_quiet(runs):
    lines = [line for line in runs["third_stderr"].splitlines() if "[qwz-qualify" in line]
    steps = [line for line in lines if "candidate-g64 step 4/4" in line]
    assert len(steps) == 1, lines  # printed once, by rank 0 alone


def test_same_head_twice_reproduces_the_hashes(runs):
    first = record.load(runs["first"] / "record.json")
    second = record.load(runs["second"] / "record.json")
    assert {h.ledger_status for h in first.hashes} == {"recorded"}
    assert {h.ledger_status for h in second.hashes} == {"reproduced"}
    assert [h.per_rank for h in first.hashes] == [h.per_rank for h in second.hashes]


def test_changed_hash_for_the_same_head_fails_naming_both(runs):
    third = record.load(runs["third"] / "record.json")
    check = next(c for c in third.checks if c.name == "reproduced[candidate-g64]")
    assert not check.passed and "MISMATCH" in check.detail
    this_run = next(h for h in third.hashes if h.arm == "candidate-g64").per_rank[0]
    assert this_run[:16] in check.detail and "0" * 16 in check.detail
    # Every quantized arm's ledger entry was doctored: the chunked arm's too.
    assert third.verdict.failed == [
        "reproduced[candidate-g64]", "reproduced[candidate-g64-chunked]"
    ]  # fmt: skip


def test_changed_group_size_changes_the_hash_and_the_check_says_so(runs, tmp_path):
    done = _cli(
        "run", "--out", str(tmp_path / "g8192"), "--ledger", str(runs["ledger"]),
        *SMALL_RUN, "--group-size", "8192",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = record.load(tmp_path / "g8192" / "record.json")
    checks = {check.name: check for check in loaded.checks}
    # This run's arms are laid out in shards of 8192 elements ([Note: padding rule]), so the
    # reference has an entry of its own; at 2 ranks no sum has three terms, so the layout
    # cannot change its hash: it is the g64 run's.
    detail = checks["reproduced[reference]"].detail
    assert detail.startswith("first run of this head")
    assert "same hash as the reference (unquantized, shards aligned to 64) arm's" in detail
    detail = checks["reproduced[candidate-g8192]"].detail
    assert detail.startswith("first run of this head")
    assert "differs from the candidate-g64 (group size 64, shards aligned to 64) arm's" in detail


def test_report_prints_the_markdown(runs):
    done = _cli("report", str(runs["first"] / "record.json"))
    assert done.returncode == 0, done.stderr
    assert "candidate-g64" in done.stdout and "PASS" in done.stdout


def test_compare_same_head_is_not_a_regression(runs):
    done = _cli("compare", str(runs["first"] / "record.json"), str(runs["second"] / "record.json"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_compare_catches_a_check_that_now_fails(runs):
    done = _cli("compare", str(runs["first"] / "record.json"), str(runs["third"] / "record.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "reproduced[candidate-g64]" in done.stdout


def test_compare_and_report_refuse_a_tampered_record(runs, tmp_path):
    payload = json.loads((runs["second"] / "record.json").read_text())
    payload["trajectories"][1]["losses"][0] += 0.25
    tampered = tmp_path / "record.json"
    tampered.write_text(json.dumps(payload))
    done = _cli("compare", str(runs["first"] / "record.json"), str(tampered))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "digest" in done.stdout + done.stderr
    done = _cli("report", str(tampered))
    assert done.returncode == 2 and "digest" in done.stderr


def test_a_diverging_run_exits_1_with_a_fail_record_naming_the_step(tmp_path):
    done = _cli("run", "--out", str(tmp_path / "diverged"), *SMALL_RUN, "--lr", "1e30")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    loaded = record.load(tmp_path / "diverged" / "record.json")
    assert loaded.verdict.status == "FAIL"
    failure = loaded.trajectories[0].failure
    assert failure is not None and failure.kind == "non-finite" and failure.ranks == [0, 1]
    report = (tmp_path / "diverged" / "report.md").read_text()
    assert "## Failures" in report and f"| `reference` | {failure.step} | 0, 1 |" in report
    done = _cli("report", str(tmp_path / "diverged" / "record.json"))
    assert done.returncode == 0 and "qualification: FAIL" in done.stdout, done.stderr
    path = str(tmp_path / "diverged" / "record.json")
    done = _cli("compare", path, path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_reference_that_does_not_learn_is_inconclusive_exit_3(tmp_path):
    done = _cli("run", "--out", str(tmp_path / "still"), *SMALL_RUN, "--lr", "1e-12")
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    loaded = record.load(tmp_path / "still" / "record.json")
    assert loaded.verdict.status == "INCONCLUSIVE" and loaded.verdict.failed == []
    assert "learning[reference]" in loaded.verdict.inconclusive


def test_one_rank_has_nothing_to_gather_and_says_so(tmp_path):
    """[Note: one rank] (qualify/evidence/rules/in_effect.py): nothing is quantized or sent, so the
    quantized gather is untested and the run is INCONCLUSIVE (exit 3), with no check failed:
    the one-rank gather copies exactly and the spec says exact there (own-shard passes).
    Known before it starts, so run refuses it unless --allow-one-rank (the refusal:
    tests/unit/qualify/request/test_run_preflight.py)."""
    args = list(SMALL_RUN)
    args[args.index("--world-size") + 1] = "1"
    done = _cli("run", "--out", str(tmp_path / "one"), *args, "--allow-one-rank")
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    loaded = record.load(tmp_path / "one" / "record.json")
    checks = {check.name: check for check in loaded.checks}
    assert loaded.verdict.status == "INCONCLUSIVE" and loaded.verdict.failed == []
    assert loaded.verdict.inconclusive == ["in-effect[candidate-g64]", "bounded[candidate-g64]"]
    assert "--world-size 2 or more" in checks["in-effect[candidate-g64]"].detail
    assert checks["own-shard[candidate-g64]"].status == "pass"
    assert checks["replicas[candidate-g64]"].status == "n/a"
    assert "in-effect[candidate-g64]" not in loaded.verdict.evidence


def test_one_arm_at_a_time_still_times_order_balanced_blocks(tmp_path):
    """--one-arm-at-a-time rebuilds the arm at each switch, during the untimed warm-up."""
    done = _cli("run", "--out", str(tmp_path / "one-arm"), *SMALL_RUN, "--one-arm-at-a-time")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    loaded = record.load(tmp_path / "one-arm" / "record.json")
    assert loaded.plan.model_dump()["one_arm_at_a_time"] is True
    assert [block.order for block in loaded.performance[0].blocks] == ["AB", "BA"]
    done = _cli("run", "--out", str(tmp_path / "no-warmup"), *SMALL_RUN[:-4], "--kernels", "eager",
                "--warmup-steps", "0", "--one-arm-at-a-time", "--world-size", "2")  # fmt: skip
    assert done.returncode == 2 and "--warmup-steps >= 1" in done.stderr


def test_run_rejects_an_invalid_group_size():
    done = _cli("run", "--out", "unused", "--group-size", "60")
    assert done.returncode == 2
    assert "multiple of 8" in done.stderr


def test_deepspeed_subject_passes_and_stock_deepspeed_is_caught_not_in_effect(tmp_path):
    """`--subject deepspeed`: stock DeepSpeed ZeRO-2 is the reference, DeepSpeed with qwz's
    gather the candidate. With the integration disabled the request reaches stock DeepSpeed,
    which ignores it: the run must fail with "not in effect"."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    done = _cli("run", "--out", str(tmp_path / "ds"), "--subject", "deepspeed", *SMALL_RUN)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    loaded = record.load(tmp_path / "ds" / "record.json")
    assert loaded.subject.name == "deepspeed" and loaded.subject.version.startswith("0.19")
    assert loaded.verdict.passed
    done = _cli(
        "run", "--out", str(tmp_path / "stock"), "--subject", "deepspeed", "--no-qwz-gather",
        *SMALL_RUN,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    stock = record.load(tmp_path / "stock" / "record.json")
    failed = {check.name: check for check in stock.checks if not check.passed}
    assert "in-effect[candidate-g64]" in failed
    assert "not in effect" in failed["in-effect[candidate-g64]"].detail
