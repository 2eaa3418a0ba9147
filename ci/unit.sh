#!/usr/bin/env bash
# Unit suite only (no process groups): what every pull request runs on a CPU runner.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
status=0
python -m pytest -n 2 -m "not multigpu" --durations=15 tests/unit "$@" || status=$?
[ "$status" -eq 5 ] && { echo "ci/unit.sh: no tests collected" >&2; exit 1; }
exit "$status"
