"""ci/nightly-bisect.sh: what the nightly hands ``qwz-qualify bisect`` when a stage fails (a
stub ``qwz-qualify`` on PATH records its arguments), and when it declines to bisect."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "nightly-bisect.sh"
STUB = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$STUB_ARGS"
out=""; while [ "$#" -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done
mkdir -p "$out" && echo "# bisect" > "$out/bisect.md"
exit 0
"""


def _git(repository: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repository), *args], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def _setup(tmp_path: pathlib.Path, tonight_status: str, baseline_sha: str | None = None):
    repository = tmp_path / "repo"
    repository.mkdir()
    _git(repository, "init", "--quiet")
    for index in range(2):
        (repository / "f").write_text(str(index))
        _git(repository, "add", "f")
        _git(repository, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", f"c{index}")
    first = _git(repository, "rev-list", "--max-parents=0", "HEAD")
    sha = first if baseline_sha is None else baseline_sha
    (tmp_path / "baseline.json").write_text(json.dumps({"head": {"sha": sha, "dirty": False}}))
    (tmp_path / "tonight.json").write_text(json.dumps({"verdict": {"status": tonight_status}}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qwz-qualify").write_text(STUB)
    (bin_dir / "qwz-qualify").chmod(0o755)
    return repository, first


def _run(tmp_path: pathlib.Path, *run_args: str, **env: str) -> subprocess.CompletedProcess:
    path = f"{tmp_path / 'bin'}{os.pathsep}{pathlib.Path(sys.executable).parent}{os.pathsep}"
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "baseline.json"), str(tmp_path / "tonight.json"),
         str(tmp_path / "out"), str(tmp_path / "tonight.txt"), *run_args],
        cwd=tmp_path / "repo", capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": path + os.environ["PATH"],
             "STUB_ARGS": str(tmp_path / "args.txt"), **env},
    )  # fmt: skip


def test_a_failed_check_is_bisected_from_the_baseline_commit_without_the_ledger(tmp_path):
    repository, first = _setup(tmp_path, "FAIL")
    done = _run(tmp_path, "--stage", "2", "--ledger", "L", "--workload", "mlp")
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args.txt").read_text().split("\n")[:-1]
    head = _git(repository, "rev-parse", "HEAD")
    assert args == ["bisect", "--repo", ".", "--good", first, "--bad", head, "--out",
                    str(tmp_path / "out"), "--", "--stage", "2", "--workload", "mlp"]  # fmt: skip
    assert (tmp_path / "tonight.txt").read_text() == f"{tmp_path / 'out' / 'bisect.md'}\n"


def test_a_passing_night_whose_gate_failed_bisects_the_speed_of_the_deepspeed_checkout(tmp_path):
    repository, _ = _setup(tmp_path, "PASS")
    done = _run(tmp_path, "--subject", "deepspeed-native", "--deepspeed-src", str(repository))
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[:3] == ["bisect", "--repo", str(repository)] and "--speed" in args
    assert args[args.index("--") + 1 :][:2] == ["--subject", "deepspeed-native"]
    assert "--deepspeed-src" not in args


def test_no_bisect_without_a_known_baseline_commit_or_when_turned_off(tmp_path):
    _setup(tmp_path, "FAIL", baseline_sha="unknown")
    done = _run(tmp_path, "--stage", "2")
    assert done.returncode == 0 and "names no clean commit" in done.stderr
    assert not (tmp_path / "args.txt").exists()
    (tmp_path / "baseline.json").write_text(json.dumps({"head": {"sha": "0" * 40}}))
    assert "names no clean commit" in _run(tmp_path, "--stage", "2").stderr
    off = _run(tmp_path, "--stage", "2", QWZ_NIGHTLY_BISECT="0")
    assert off.returncode == 0 and "not bisecting" in off.stderr
    assert not (tmp_path / "args.txt").exists()


def test_a_matrix_night_bisects_its_failed_cells_with_their_own_arguments(tmp_path):
    repository, first = _setup(tmp_path, "FAIL")
    baseline, tonight = tmp_path / "baseline-matrix", tmp_path / "tonight-matrix"
    cells = [
        ("stage1", "PASS", ["--stage", "1"]),
        ("stage2", "FAIL", ["--stage", "2", "--ledger", "L"]),
        ("nobase", "FAIL", ["--stage", "3"]),
    ]
    for cell, status, _ in cells:
        for root, verdict in ((baseline, "PASS"), (tonight, status)):
            if root is baseline and cell == "nobase":
                continue
            (root / "cells" / cell).mkdir(parents=True)
            record = {"head": {"sha": first, "dirty": False}, "verdict": {"status": verdict}}
            (root / "cells" / cell / "record.json").write_text(json.dumps(record))
    rows = [{"id": c, "status": s, "arguments": a, "record": f"cells/{c}/record.json"}
            for c, s, a in cells]  # fmt: skip
    (tonight / "matrix.json").write_text(json.dumps({"cells": rows}))
    path = f"{tmp_path / 'bin'}{os.pathsep}{pathlib.Path(sys.executable).parent}{os.pathsep}"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--matrix", str(baseline), str(tonight), str(tmp_path / "out"),
         str(tmp_path / "tonight.txt")],
        cwd=repository, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": path + os.environ["PATH"],
             "STUB_ARGS": str(tmp_path / "args.txt")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args.txt").read_text().split("\n")[:-1]
    assert args[args.index("--out") + 1] == str(tmp_path / "out" / "stage2")
    assert args[args.index("--") + 1 :] == ["--stage", "2"]  # the failed cell's, ledger dropped
    assert "--speed" not in args
    assert (
        tmp_path / "tonight.txt"
    ).read_text() == f"{tmp_path / 'out' / 'stage2' / 'bisect.md'}\n"
