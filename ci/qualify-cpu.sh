#!/usr/bin/env bash
# The main job: CPU qualification of the default workload (tiny Qwen3, 2 ranks, gloo),
# writing runs/cpu-qualify/{record.json,report.md} and its plots (loss.png, held_out.png,
# speedup.png, step_times.png), or, where no verdict was reached, the one file that says why
# (harness-error.json, timed-out.json, interrupted.json).
# Extra arguments go to `qwz-qualify run`, e.g. `--group-size 64 --group-size 8192`.
# Every run is kept: the previous one moves to runs/cpu-qualify.1, that one to .2, and so on;
# the QWZ_KEEP_RUNS (default 3) most recent are kept ([Note: results kept] in
# qwz/qualify/evidence/run_dir.py). The ledger then shows whether a run reproduced the
# earlier hashes.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
out="${QWZ_OUT:-runs/cpu-qualify}"
qwz-qualify run --out "$out" --world-size 2 --ledger runs/ledger \
  --keep-previous "${QWZ_KEEP_RUNS:-3}" "$@"
echo "report: $out/report.md"
