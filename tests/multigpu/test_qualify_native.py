"""End to end: ``qwz-qualify run --subject deepspeed-native --deepspeed-src PATH`` on stock
DeepSpeed 0.19 (a copy of the installed package in a temporary git repository,
tests/deepspeed_checkout.py: the ``main`` branch of the checkout the multigpu tests share).

Stock 0.19 accepts ``zero_quantized_weights`` at stage 2 and does nothing with it: at the
default group size (the key left out) it trains and FAILs ``in-effect``; its strict config
refuses ``zero_quantized_weights_group_size``, so G = 8192 is refused before training
(exit 2) with DeepSpeed's own message, version and commit.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from qwz.qualify.evidence import record
from tests import warm_python
from tests.deepspeed_checkout import head, use_variant

pytestmark = pytest.mark.multigpu
pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

TINY_RUN = [
    "--subject", "deepspeed-native", "--workload", "mlp", "--steps", "2", "--blocks", "1",
    "--block-steps", "1", "--warmup-steps", "0", "--no-calibration", "--world-size", "2",
    "--kernels", "eager",
]  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess:
    return warm_python.run(
        ["-m", "qwz.qualify", *args], timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


@pytest.fixture
def checkout(deepspeed_variants) -> pathlib.Path:
    """Stock DeepSpeed: the ``main`` branch of the worker's one checkout (tests/multigpu/
    conftest.py), so its op is built once per worker, not once more for this module."""
    use_variant(deepspeed_variants, "main")
    return deepspeed_variants


def test_stock_deepspeed_fails_in_effect_and_binds_the_checkout(checkout, tmp_path):
    """G = 64: trains, FAILs in-effect; the record's head is the checkout's commit, clean.
    With an uncommitted edit: dirty, and a ledger key of its own (recorded, not compared
    with the clean run's hashes)."""
    ledger = tmp_path / "ledger"
    source = ["--deepspeed-src", str(checkout), "--ledger", str(ledger)]
    done = _cli("run", "--out", str(tmp_path / "clean"), *TINY_RUN, *source)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    clean = record.load(tmp_path / "clean" / "record.json")
    failed = {check.name: check for check in clean.checks if check.status == "fail"}
    assert "in-effect[candidate-g64]" in failed
    assert "not in effect" in failed["in-effect[candidate-g64]"].detail
    # Its config refuses the group size key (an unknown field) and ignores the flag with fp32
    # and ZenFlow: conformance shows each refusal with DeepSpeed's message and fails the rest.
    assert "stage2-g8192" in failed["conformance"].numbers["failed"]
    assert "stage2-fp32" in failed["conformance"].numbers["failed"]
    assert clean.conformance is not None
    refusals = [row.message for row in clean.conformance.rows if row.observed == "refused"]
    assert refusals and all("Extra inputs are not permitted" in text for text in refusals)
    assert clean.subject.name == "deepspeed-native" and clean.subject.version == "0.19.8"
    assert clean.head.sha == clean.subject.sha == head(checkout)
    assert clean.head.dirty is False and clean.subject.dirty is False
    assert clean.subject.import_path == str(checkout.resolve() / "deepspeed")
    assert clean.harness is not None and clean.harness.sha != clean.head.sha
    zero = next(arm for arm in clean.arms if arm.name == "candidate-g64").config
    assert zero["zero_optimization"]["zero_quantized_weights"] is True
    assert "zero_quantized_weights_group_size" not in zero["zero_optimization"]
    assert {h.ledger_status for h in clean.hashes} == {"recorded"}
    report = (tmp_path / "clean" / "report.md").read_text()
    assert report.startswith("# DeepSpeed qualification (DeepSpeed's own code), deepspeed 0.19.8")
    assert "| `candidate-g64` | requested | 64 |" in report

    engine = checkout / "deepspeed" / "runtime" / "engine.py"
    original = engine.read_text()
    try:
        engine.write_text(original + "\n# an uncommitted edit\n")
        done = _cli("run", "--out", str(tmp_path / "dirty"), *TINY_RUN, *source)
    finally:
        engine.write_text(original)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    dirty = record.load(tmp_path / "dirty" / "record.json")
    assert dirty.head.sha == clean.head.sha and dirty.head.dirty is True
    assert dirty.subject.dirty is True and dirty.subject.diff_sha256 is not None
    # The same hashes (a comment changes nothing), but another key: recorded, not reproduced.
    assert [h.per_rank for h in dirty.hashes] == [h.per_rank for h in clean.hashes]
    assert {h.ledger_status for h in dirty.hashes} == {"recorded"}
    assert len(list(ledger.glob("*.json"))) == 2 * len(clean.hashes)
    entry = json.loads(next(ledger.glob("*.json")).read_text())
    assert entry["head"]["subject"]["name"] == "deepspeed-native"


def test_stock_deepspeed_refuses_a_group_size_before_training(checkout, tmp_path):
    out = tmp_path / "g8192"
    done = _cli("run", "--out", str(out), *TINY_RUN, "--deepspeed-src", str(checkout),
                "--group-size", "8192")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "refuses the config of arm 'candidate-g8192'" in done.stderr
    assert "zero_quantized_weights_group_size Extra inputs are not permitted" in done.stderr
    assert f"DeepSpeed 0.19.8 at {head(checkout)[:12]}" in done.stderr
    assert "[qwz-qualify" not in done.stderr  # no rank started
    assert not (out / "record.json").exists()


def test_deepspeed_src_is_refused_where_it_cannot_apply(tmp_path):
    done = _cli("run", "--out", str(tmp_path / "a"), "--deepspeed-src", str(tmp_path))
    assert done.returncode == 2 and "--deepspeed-src applies to --subject" in done.stderr
    done = _cli("run", "--out", str(tmp_path / "b"), *TINY_RUN, "--deepspeed-src", str(tmp_path))
    assert done.returncode == 2 and "no deepspeed/__init__.py there" in done.stderr
