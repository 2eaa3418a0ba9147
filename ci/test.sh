#!/usr/bin/env bash
# The test command: unit and multigpu suites together (gloo on CPU, NCCL with enough GPUs).
# Extra arguments go to pytest, e.g. `bash ci/test.sh -m multigpu`. Each file runs whole on one
# worker, longest file first ([Note: longest file first] in tests/file_order.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
status=0
python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "ci/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
