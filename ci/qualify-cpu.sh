#!/usr/bin/env bash
# The main job: CPU qualification of the default workload (tiny Qwen3, 2 ranks, gloo),
# writing runs/cpu-qualify/{record.json,report.md,loss.png,speedup.png}.
# Extra arguments go to `qwz-qualify run`, e.g. `--group-size 64 --group-size 8192`.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
out="${QWZ_OUT:-runs/cpu-qualify}"
# --force: the main job owns runs/cpu-qualify and is meant to be re-run (the ledger then
# shows whether the new run reproduced the earlier hashes).
qwz-qualify run --out "$out" --world-size 2 --ledger runs/ledger --force "$@"
echo "report: $out/report.md"
