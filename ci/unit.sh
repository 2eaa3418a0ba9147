#!/usr/bin/env bash
# Unit suite only (no process groups): the fast tier of a contributor's inner loop, without the
# tests marked `slow` (torch.compile in fresh processes, long properties: minutes on 2 cores).
# QWZ_SLOW_TESTS=1 runs those too, as the pull-request job does (.github/workflows/ci.yml);
# `bash ci/test.sh` always runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
markers="not multigpu and not slow"
[ "${QWZ_SLOW_TESTS:-0}" = "1" ] && markers="not multigpu"
status=0
python -m pytest -n 2 -m "$markers" --durations=15 tests/unit "$@" || status=$?
[ "$status" -eq 5 ] && { echo "ci/unit.sh: no tests collected" >&2; exit 1; }
exit "$status"
