"""``qwz-qualify matrix`` end to end: real ``run`` subprocesses on the mlp workload, a
refused cell, SIGTERM while a cell runs (the finished cell kept, exit 143), the same
command continuing the matrix, and ``compare`` of the matrix directory with itself."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests import warm_python

pytestmark = pytest.mark.multigpu

SPEC = """
[matrix]
name = "e2e"
[defaults]
steps = 4
eval_every = 2
blocks = 2
block_steps = 1
warmup_steps = 1
compile = false
[[cells]]
name = "two-seeds"
workload = "mlp"
seed = [0, 1]
[[cells]]
name = "too-many-ranks"
workload = "mlp"
world_size = 4096
[[out_of_scope]]
scope = "offload"
reason = "offload: not supported by the quantized gather"
"""
FIRST = "qwz-s2-bf16-g64-mlp-w2-default-seed0"
SECOND = "qwz-s2-bf16-g64-mlp-w2-default-seed1"
REFUSED = "qwz-s2-bf16-g64-mlp-w4096-default-seed0"


def _matrix(spec: pathlib.Path, out: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "qwz.qualify", "matrix", str(spec), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def _wait_for(path: pathlib.Path, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.2)


def _rows(out: pathlib.Path) -> dict[str, dict]:
    return {row["id"]: row for row in json.loads((out / "matrix.json").read_text())["cells"]}


def test_a_stopped_matrix_keeps_its_finished_cell_and_continues(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    process = _matrix(spec, out)
    _wait_for(out / "cells" / FIRST / "record.json", process, 300)
    _wait_for(out / "logs" / f"{SECOND}.err", process, 60)
    time.sleep(1.0)  # the second cell's run is starting: torch alone takes longer
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 143, stderr
    # The signal reached the cell's run (which stops its ranks within 10 s), not the
    # matrix's SIGKILL after STOP_GRACE_S.
    assert time.monotonic() - signalled < 30, stderr
    rows = _rows(out)
    assert rows[FIRST]["status"] == "PASS"
    assert (rows[SECOND]["status"], rows[SECOND]["kind"]) == ("not run", "interrupted")
    assert not (out / "cells" / SECOND / "record.json").exists()
    digest = rows[FIRST]["digest"]

    again = _matrix(spec, out)
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    rows = _rows(out)
    assert (rows[FIRST]["kind"], rows[FIRST]["digest"]) == ("resumed", digest)
    assert (rows[SECOND]["status"], rows[SECOND]["kind"]) == ("PASS", "ran")
    assert (rows[REFUSED]["status"], rows[REFUSED]["kind"]) == ("not run", "refused")
    assert "--world-size 4096" in rows[REFUSED]["reason"], rows[REFUSED]["reason"]
    assert rows["offload"]["reason"] == "offload: not supported by the quantized gather"
    text = (out / "matrix.md").read_text()
    assert f"`{SECOND}`" in text and rows[SECOND]["digest"][:12] in text

    compared = warm_python.run(["-m", "qwz.qualify", "compare", str(out), str(out)], timeout=120)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert f"cell {FIRST}: result: no regression" in compared.stdout
