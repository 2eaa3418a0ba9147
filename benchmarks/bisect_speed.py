"""A ``--speed`` bisect over a history with a planted 30% slowdown; read here, never asserted
in a test (speed is measured, not timed in assertions).

    python benchmarks/bisect_speed.py [--out DIR]

Builds a temporary 7-commit history of a copy of this checkout's qwz in which commit 5 makes
the quantized gather sleep 0.3x the preceding step (tests/multigpu/bisect_history.py), runs
``qwz-qualify bisect --speed`` from the first commit (good) to the last (bad), and prints
whether it named the planted commit, the wall time and how many qualifications it ran. Exit
0 when the planted commit was named, 1 otherwise. Run it on a quiet machine: the speed
oracle compares speed-up intervals, which a loaded machine widens.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multigpu import bisect_history  # noqa: E402

HISTORY = [
    ("docs: one", None),
    ("docs: two", None),
    ("docs: three", None),
    ("docs: four", None),
    ("collectives: slower gather", bisect_history.SLOW_GATHER),
    ("docs: six", None),
    ("docs: seven", None),
]
PLANTED = 5
RUN_ARGS = ["--workload", "mlp", "--steps", "2", "--eval-every", "1", "--blocks", "16",
            "--block-steps", "4", "--warmup-steps", "1", "--no-calibration"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default: a temp dir")
    args = parser.parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="qwz-bisect-speed-"))
    shas = bisect_history.build(out / "repo", HISTORY)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qwz.qualify",
            "bisect",
            "--repo",
            str(out / "repo"),
            "--good",
            shas[0],
            "--bad",
            shas[-1],
            "--out",
            str(out / "bisect"),
            "--speed",
            "--",
            *RUN_ARGS,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    wall_s = time.monotonic() - started
    result_path = out / "bisect" / "bisect.json"
    if not result_path.is_file():
        print(f"bisect exited {done.returncode} without bisect.json ({wall_s:.0f} s)")
        return 1
    result = json.loads(result_path.read_text())
    named = (result.get("first_bad") or {}).get("sha")
    found = named == shas[PLANTED]
    print((out / "bisect" / "bisect.md").read_text())
    print(
        f"speed bisect: exit {done.returncode}, {'named' if found else 'did NOT name'} the "
        f"planted commit {shas[PLANTED][:12]} (named: {named}), {wall_s:.0f} s, "
        f"{result.get('qualifications_run')} qualifications"
    )
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
