"""``kill -TERM`` of a running ``qwz-qualify run`` stops every rank within 10 s and leaves no
process behind ([Note: no orphaned ranks] in qwz/qualify/run/launch.py), and says how far the run
got in ``interrupted.json``; a run that outlasts its ``--timeout`` ends TIMED-OUT naming the
limit ([Note: unfinished runs] in qwz/qualify/evidence/unfinished.py). SIGINT takes the same
path; its unit test is in tests/unit/qualify/request/test_run_preflight.py."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import warm_python

pytestmark = pytest.mark.multigpu

LONG_RUN = [
    "--workload", "mlp", "--steps", "100000", "--blocks", "1", "--block-steps", "1",
    "--warmup-steps", "0", "--world-size", "2", "--kernels", "eager", "--timeout", "86400",
]  # fmt: skip
"""Stopped long before its end; a limit it could meet, else it is refused before it starts
([Note: the time floor] in qwz/qualify/request/time_floor.py)."""


def _descendants(root: int) -> set[int]:
    """Every live process below ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_every_rank_within_10_s(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "qwz.qualify", "run", "--out", str(tmp_path / "out"), *LONG_RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    stderr_lines: list[str] = []
    training = threading.Event()

    def read_stderr() -> None:
        for line in process.stderr:
            stderr_lines.append(line)
            if re.search(r" step \d+/", line):  # rank 0 reports training progress
                training.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert training.wait(timeout=180), "".join(stderr_lines)[-3000:]
        ranks = _descendants(process.pid)
        assert len(ranks) >= 2, ranks
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = process.wait(timeout=10)
        deadline = started + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.1)
        survivors = [pid for pid in ranks if _alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 143, "".join(stderr_lines)[-3000:]
    assert survivors == [], f"left behind: {survivors}"
    assert "interrupted by SIGTERM" in "".join(stderr_lines)
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["interrupted.json"]
    written = json.loads((tmp_path / "out" / "interrupted.json").read_text())
    assert (written["verdict"], written["interrupted"]) == (None, "SIGTERM")
    assert written["phase"] == "training the arms"
    assert written["arms"]["running"] == "reference", written
    assert written["arms"]["not_started"][-1] == "candidate-g64-chunked", written
    assert {where["arm"] for where in written["arms"]["ranks"].values()} == {"reference"}


def test_a_run_that_outlasts_its_timeout_ends_timed_out_naming_the_limit(tmp_path):
    """The run's --timeout, not the subject, ended it: exit 3 and timed-out.json, never a FAIL
    record (before: exit 1, ``FAIL: finite[reference]``, "a hang or a deadlock"). The time
    floor is emptied so that a 3 s limit is not refused before the ranks start."""
    code = (
        "import sys; from qwz.qualify import cli; from qwz.qualify.request import time_floor; "
        "time_floor.CPU_STEP_FLOOR_S.clear(); sys.exit(cli.main(sys.argv[1:]))"
    )
    out = tmp_path / "out"
    done = warm_python.run(
        ["-c", code, "run", "--out", str(out), *LONG_RUN, "--timeout", "3"], timeout=300
    )
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert sorted(path.name for path in out.iterdir()) == ["timed-out.json"]
    written = json.loads((out / "timed-out.json").read_text())
    assert (written["verdict"], written["limit_s"]) == ("TIMED-OUT", 3.0)
    assert written["arms"]["running"] == "reference" and written["arms"]["finished"] == []
    assert "TIMED-OUT: the run's time limit, --timeout 3 s, ran out in arm reference" in (
        done.stdout
    )
