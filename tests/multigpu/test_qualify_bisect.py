"""``qwz-qualify bisect`` over real qualifications: a temporary history of a copy of qwz in
which one commit plants the mutation suite's ``scale_absmax_over_128`` as a code change in
qwz/quant.py and an earlier one does not import; the bisect (the CLI, as a subprocess) must
name the planted commit for the check that fails and for ``--hash``, skip the commit that
does not import, survive a SIGTERM and resume without re-running anything recorded.

The qualifications are tiny (the ``mlp`` workload, 4 steps, one timing block, eager kernels so
quant.py's formula is the one on the wire). The speed bisect times real steps, so it is a
benchmark, not a test: ``python benchmarks/bisect_speed.py`` (run by the nightly)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from . import bisect_history

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

RUN_ARGS = [
    "--workload",
    "mlp",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--blocks",
    "0",
    "--no-calibration",
    "--kernels",
    "eager",
    # The candidate's own gather chunks at least as finely as the chunked arm would (9472 on
    # mlp at W=2), so the run needs no chunked arm ([Note: the chunked arm]): two arms per
    # commit, not three.
    "--allgather-bucket-size",
    "8192",
]
ROOT = pathlib.Path(__file__).resolve().parents[2]
PLANTED = 6
"""The index of the commit that plants the bug (index 4 does not import, 5 repairs it)."""


def _qwz_qualify(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "qwz.qualify", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _finished(out: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Every finished attempt's files: path -> (mtime_ns, sha256)."""
    files = {}
    for outcome in sorted((out / "commits").rglob("outcome.json")):
        for path in sorted(outcome.parent.iterdir()):
            if path.is_file():
                files[str(path)] = (
                    path.stat().st_mtime_ns,
                    hashlib.sha256(path.read_bytes()).hexdigest(),
                )
    return files


def _training(out: pathlib.Path) -> list[pathlib.Path]:
    """Attempts without an outcome whose ranks have reported a training step."""
    return [
        log.parent
        for log in (out / "commits").glob("*/*/run.log")
        if not (log.parent / "outcome.json").exists() and re.search(r" step \d+/", log.read_text())
    ]


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    root = tmp_path_factory.mktemp("bisect")
    h = bisect_history
    shas = h.build(
        root / "repo",
        [
            ("docs: one", None),
            ("docs: two", None),
            ("docs: three", None),
            ("quant: import a helper", h.BREAK_IMPORT),
            ("quant: drop the helper", h.undo(h.BREAK_IMPORT)),
            ("quant: scale from absmax/128", h.BUG_SCALE),
            ("docs: seven", None),
            ("docs: eight", None),
        ],
    )
    return root, shas


def _bisect_args(root: pathlib.Path, shas: list[str], *flags: str) -> list[str]:
    return [
        "bisect",
        "--repo",
        str(root / "repo"),
        "--good",
        shas[0],
        "--bad",
        shas[-1],
        "--out",
        str(root / "out"),
        *flags,
        "--",
        *RUN_ARGS,
    ]


# Nightly: three to four minutes on 2 cores. In CI, tests/unit/qualify/bisect/test_bisect.py kills,
# resumes and skips over fake trials, and the `git bisect run` test below qualifies real commits.
@pytest.mark.nightly
def test_a_killed_check_bisect_resumes_skips_the_broken_import_and_names_the_commit(history):
    root, shas = history
    setups = root / "setups.txt"
    flags = ("--setup", f"echo $QWZ_BISECT_COMMIT >> {setups}")
    started = time.monotonic()
    bisect = _qwz_qualify(*_bisect_args(root, shas, *flags), start_new_session=True)
    # SIGTERM once the bad and the good head are finished and a later trial's ranks train
    # (a commit that does not import finishes at once, so a fixed sleep is not enough).
    while len(list((root / "out").glob("commits/*/*/outcome.json"))) < 2 or not _training(
        root / "out"
    ):
        assert bisect.poll() is None, bisect.stdout.read()
        time.sleep(0.2)
    bisect.send_signal(signal.SIGTERM)
    output = bisect.communicate(timeout=120)[0]
    assert bisect.returncode == 143, output
    assert "every finished attempt is kept" in output
    before = _finished(root / "out")
    finished_before = {pathlib.Path(path).parent for path in before}
    heads = {pathlib.Path(path).parents[1].name for path in before}
    assert {shas[0], shas[-1]} <= heads  # the bad and good heads
    assert not _training(root / "out") or all(
        attempt not in finished_before for attempt in _training(root / "out")
    )  # the interrupted trial left no outcome

    resumed = _qwz_qualify(*_bisect_args(root, shas, *flags))
    output = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, output
    wall_s = time.monotonic() - started
    result = json.loads((root / "out" / "bisect.json").read_text())
    assert result["first_bad"]["sha"] == shas[PLANTED], output
    assert result["first_bad"]["subject"] == "quant: scale from absmax/128"
    assert "qwz/quant.py" in result["first_bad"]["diff_stat"]
    assert result["oracle"]["checks"] == ["own-shard[candidate-g64]"]
    assert result["qualifications_reused"] == len(finished_before)
    after = _finished(root / "out")
    assert {path: after[path] for path in before} == before  # nothing recorded was re-run
    tested = {commit["sha"]: commit["attempts"] for commit in result["tested"]}
    assert tested[shas[4]][0]["verdict"] == "skip"
    assert "ModuleNotFoundError: No module named 'qwz._no_such_module'" in tested[shas[4]][0]["why"]
    qualified = {path.name for path in (root / "out" / "commits").iterdir()}
    assert set(setups.read_text().split()) == qualified  # --setup ran in every commit's worktree
    print(
        f"check bisect: {wall_s:.0f} s, {len(qualified)} commits qualified "
        f"({result['qualifications_run']} after the resume)"
    )

    again = _qwz_qualify(*_bisect_args(root, shas, *flags))
    again.communicate(timeout=300)
    repeated = json.loads((root / "out" / "bisect.json").read_text())
    assert again.returncode == 0 and repeated["qualifications_run"] == 0
    assert repeated["first_bad"] == result["first_bad"]


def test_git_bisect_run_with_the_hash_oracle_names_the_commit(history):
    """``git bisect run qwz-qualify bisect-step --hash``: git walks, the step judges, each step
    a real qualification of the commit (in the nightly, after the check bisect above, whose
    records it reuses: they do not depend on the oracle)."""
    root, shas = history
    repository = root / "repo"
    bisect_history.git(repository, "bisect", "start", shas[-1], shas[0])
    started = time.monotonic()
    try:
        # -P: git runs the step in the repository's checkout, which must not shadow this qwz
        step = [
            sys.executable,
            "-P",
            "-m",
            "qwz.qualify",
            "bisect-step",
            "--repo",
            ".",
            "--good",
            shas[0],
            "--bad",
            shas[-1],
            "--out",
            str(root / "out"),
            "--hash",
            "--setup",
            f"echo $QWZ_BISECT_COMMIT >> {root / 'setups.txt'}",
            "--",
            *RUN_ARGS,
        ]
        done = subprocess.run(
            ["git", "-C", str(repository), "bisect", "run", *step],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        bisect_history.git(repository, "bisect", "reset")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{shas[PLANTED]} is the first bad commit" in done.stdout, done.stdout
    ran = sum("qualifying" in line for line in done.stderr.splitlines())
    print(f"git bisect run --hash: {time.monotonic() - started:.0f} s, {ran} qualifications run")
