"""Real DeepSpeed checkouts through the harness: DeepSpeed's source distributions from the
package registry, unpacked into git repositories without the install-time
``git_version_info_installed.py`` (tests/deepspeed_checkout.py ``sdist_checkout``), as a
user's clone is -- DeepSpeed 0.19.8 (the installed version) and 0.19.6, which keeps no
``round_robin_bit16_offsets`` ([Note: reading DeepSpeed by capability] in
qwz/integrations/deepspeed/structure.py).

- ``--subject deepspeed-native`` on stock DeepSpeed ends FAIL on ``in-effect`` (stock does
  not quantize the gather), judged, not crashed nor a HARNESS-ERROR, with the checkout's
  real version (not DeepSpeed's "0.0.0") and commit in the record;
- ``--subject deepspeed`` (qwz's gather inside that DeepSpeed) qualifies on 0.19.6;
- a checkout whose optimizer lacks what the seam reads is refused before any rank starts.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from tests import warm_python

pytest.importorskip(
    "deepspeed", reason="the DeepSpeed integration tests need deepspeed (pip install .[deepspeed])"
)

from tests.deepspeed_checkout import SdistUnavailable, git, head, sdist_checkout

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

WORKTREE = pathlib.Path(__file__).resolve().parents[2]
SMALL_RUN = [
    "--workload", "mlp", "--group-size", "64", "--steps", "6", "--blocks", "1",
    "--block-steps", "1", "--warmup-steps", "1", "--world-size", "2", "--kernels", "eager",
]  # fmt: skip


def _checkout(version: str) -> pathlib.Path:
    try:
        return sdist_checkout(version)
    except SdistUnavailable as why:
        pytest.skip(f"no DeepSpeed {version} source: {why}")


def _qualify(root: pathlib.Path, out: pathlib.Path, subject: str) -> subprocess.CompletedProcess:
    return warm_python.run(
        ["-m", "qwz.qualify", "run", "--out", str(out), "--subject", subject,
         "--deepspeed-src", str(root), *SMALL_RUN],
        cwd=WORKTREE, timeout=1800, env=dict(os.environ, DS_ACCELERATOR="cpu", QWZ_BACKEND="gloo"),
    )  # fmt: skip


@pytest.mark.parametrize(
    "version", ["0.19.6", pytest.param("0.19.8", marks=pytest.mark.nightly)]
)  # 0.19.8 in CI is the installed copy (test_deepspeed_native.py); its sdist checkout nightly
def test_stock_native_checkout_fails_in_effect_with_its_real_version_and_commit(tmp_path, version):
    from qwz.qualify.evidence import record

    root = _checkout(version)
    done = _qualify(root, tmp_path / "out", "deepspeed-native")
    said = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 1, said  # a verdict: not 4 (HARNESS-ERROR), not 2 (refused)
    loaded = record.load(tmp_path / "out" / "record.json")
    assert loaded.verdict.status == "FAIL"
    assert "in-effect[candidate-g64]" in loaded.verdict.failed, loaded.verdict
    assert all(t.failure is None for t in loaded.trajectories), "an arm crashed or diverged"
    assert loaded.environment.world_size == 2
    assert (loaded.subject.version, loaded.environment.deepspeed) == (version, version)
    assert loaded.subject.sha == loaded.head.sha == head(root)
    assert loaded.head.dirty is False
    assert loaded.subject.import_path == str(root / "deepspeed")


def test_deepspeed_subject_qualifies_on_a_checkout_without_the_offsets_list(tmp_path):
    from qwz.qualify.evidence import record

    root = _checkout("0.19.6")
    done = _qualify(root, tmp_path / "out", "deepspeed")
    said = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, said
    loaded = record.load(tmp_path / "out" / "record.json")
    assert loaded.verdict.status == "PASS"
    assert loaded.subject.version == "0.19.6" and loaded.subject.sha == head(root)


def test_a_checkout_the_seam_cannot_read_is_refused_before_any_rank_starts(tmp_path):
    stock = _checkout("0.19.6")
    root = tmp_path / "DeepSpeed"
    shutil.copytree(stock, root, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    optimizer = root / "deepspeed" / "runtime" / "zero" / "stage_1_and_2.py"
    text = optimizer.read_text()
    assert "self.single_partition_of_fp32_groups =" in text
    optimizer.write_text(text.replace("single_partition_of_fp32_groups", "fp32_partitions"))
    git(root, "commit", "-q", "-am", "rename the fp32 partitions")
    for subject in ("deepspeed-native", "deepspeed"):
        done = _qualify(root, tmp_path / subject, subject)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert "lacks DeepSpeedZeroOptimizer.single_partition_of_fp32_groups" in done.stderr
        assert f"DeepSpeed 0.19.6 at {head(root)}" in done.stderr
        assert not (tmp_path / subject / "record.json").exists()
        assert "qwz-qualify " not in done.stderr.replace("qwz-qualify run: error:", "")
