#!/usr/bin/env bash
# The review step of ci/gpu-check.sh: `qwz-qualify review` of the proposal as a pull request --
# base = the installed DeepSpeed as a git repository, head = tests/deepspeed_native/proposal.patch
# on top (ci/review_checkout.py) -- at world size = the number of GPUs, on the tiny `mlp`
# workload, its claims table printed last (ci/gpu-check.sh copies it into its summary).
#
#   bash ci/gpu-review.sh OUT_DIR GPUS
#
# Exit: the review's (0 PASS, 1 FAIL, 2 refused, 3 INCONCLUSIVE, 4 HARNESS-ERROR); 0 with a
# "skipped: ..." line where there are fewer than 2 GPUs (one rank gathers by a local copy:
# nothing is quantized or sent, so a review would only say INCONCLUSIVE).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$1"
gpus="$2"
if [ "$gpus" -lt 2 ]; then
  echo "skipped: $gpus GPU here; a review needs a world of at least 2 ranks (one rank's gather is a local copy: nothing is quantized or sent)"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # ci/review_checkout.py imports tests/
rm -rf "$out/repository" "$out/review"  # a fresh repository, and a review of it (its worktree)
mkdir -p "$out"
repo="$(python ci/review_checkout.py "$out/repository")"
rc=0
qwz-qualify review --repo "$repo" --base HEAD~1 --head HEAD --out "$out/review" \
  --workload mlp --world-size "$gpus" --steps 8 --eval-every 4 --blocks 4 --block-steps 2 \
  --warmup-steps 1 || rc=$?
if [ -f "$out/review/review.md" ]; then
  awk '/^## Claims/{show=1} /^## Default path unchanged/{show=0} show' "$out/review/review.md" \
    > "$out/claims.md"
  cat "$out/claims.md"
fi
exit "$rc"
