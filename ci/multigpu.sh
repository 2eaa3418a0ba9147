#!/usr/bin/env bash
# `pytest -m multigpu` as the GPU runners call it. NCCL is used when the machine has at least
# as many GPUs as a test's world size (2 and 4); QWZ_BACKEND=gloo|nccl forces a backend.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
status=0
python -m pytest -m multigpu tests/multigpu "$@" || status=$?
[ "$status" -eq 5 ] && { echo "ci/multigpu.sh: no tests collected" >&2; exit 1; }
exit "$status"
