"""The review step of ci/gpu-check.sh (ci/gpu-review.sh) on a machine without a GPU: it skips
with its reason below two GPUs, prepares the repository it reviews (the installed DeepSpeed
as the base, the proposal patch as the head), calls ``qwz-qualify review`` with the GPUs as
the world size, and prints the claims table that ci/gpu-check.sh copies into its summary. A
fake ``qwz-qualify`` first on PATH stands in for the review (which needs the GPUs); the real
review is tests/multigpu/test_qualify_review.py."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.deepspeed_checkout import git

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "gpu-review.sh"
CLAIMS = (
    "| claim | decided by | verdict | detail |\n|---|---|---|---|\n"
    "| bounded staging | x | **PASS** | y |\n"
)
REVIEW_MD = f"# Review\n\n## Claims\n\n{CLAIMS}\n## Default path unchanged\n\nnot in the summary\n"
FAKE_REVIEW = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_ARGV"
out=""
while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done
mkdir -p "$out"
cp "$FAKE_REVIEW_MD" "$out/review.md"
"""


def _run(tmp_path: pathlib.Path, gpus: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "qwz-qualify"
    fake.write_text(FAKE_REVIEW)
    fake.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_ARGV": str(tmp_path / "argv"),
        "FAKE_REVIEW_MD": str(tmp_path / "review.md"),
    }
    (tmp_path / "review.md").write_text(REVIEW_MD)
    out = tmp_path / "out"
    return subprocess.run(
        ["bash", str(SCRIPT), str(out), str(gpus)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_one_gpu_skips_the_review_with_its_reason(tmp_path):
    done = _run(tmp_path, 1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("skipped: 1 GPU here; a review needs a world of at least 2")
    assert not (tmp_path / "argv").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow  # copies the installed DeepSpeed into a git repository
def test_two_gpus_review_the_proposal_against_the_installed_deepspeed(tmp_path):
    pytest.importorskip("deepspeed", reason="the checkout copies the installed deepspeed")
    done = _run(tmp_path, 2)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().split("\n")[:-1]
    repository = tmp_path / "out" / "repository" / "DeepSpeed"
    assert argv[:9] == ["review", "--repo", str(repository), "--base", "HEAD~1", "--head",
                        "HEAD", "--out", str(tmp_path / "out" / "review")]  # fmt: skip
    assert argv[argv.index("--world-size") + 1] == "2"
    assert argv[argv.index("--workload") + 1] == "mlp"
    # The repository: stock, then the proposal.
    assert git(repository, "rev-list", "--count", "HEAD").strip() == "2"
    changed = git(repository, "diff", "--name-only", "HEAD~1", "HEAD").split()
    assert "deepspeed/runtime/zero/quantized_allgather.py" in changed
    # The claims table, printed and kept for the summary; nothing after it.
    claims = (tmp_path / "out" / "claims.md").read_text()
    assert claims.startswith("## Claims") and CLAIMS in claims
    assert "Default path" not in claims and done.stdout.endswith(claims)


def test_gpu_check_runs_the_review_before_the_suite_and_summarises_its_claims():
    text = (REPO / "ci" / "gpu-check.sh").read_text()
    review = 'step "review-w${gpus}" 300 "0" bash ci/gpu-review.sh "$out/review" "$gpus"'
    assert review in text
    assert text.index(review) < text.index('step "multigpu-suite-${gpus}gpu"')
    assert 'sed \'s/^## Claims$//\' "$out/review/claims.md"; } >> "$summary"' in text
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert "set -euo pipefail" in SCRIPT.read_text().splitlines()[:15]
    assert os.access(SCRIPT, os.X_OK)
