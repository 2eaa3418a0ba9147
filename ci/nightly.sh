#!/usr/bin/env bash
# Nightly requalification: stages 1 and 2, group sizes 64 and 8192, into runs/nightly/<date>/,
# then the regression gate against the last qualified record of each stage. Exit non-zero on
# a failed check, a regression, or records that cannot be compared.
#
# Environment: QWZ_NIGHTLY_WORKLOAD (default qwen3-tiny; qwen3-0.6b on GPU runners),
# QWZ_NIGHTLY_DIR (default runs/nightly), QWZ_WORLD_SIZE (default: GPU count if >= 2, else 2),
# QWZ_MIN_SPEEDUP (optional lower bound on the speed-up interval), QWZ_NEW_BASELINE=1 to
# accept a run as the first qualified baseline of a stage (without it, a missing baseline is
# a failure: a lost baseline must never turn the gate into a pass).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
workload="${QWZ_NIGHTLY_WORKLOAD:-qwen3-tiny}"
root="${QWZ_NIGHTLY_DIR:-runs/nightly}"
today="$(date -u +%Y-%m-%d)"
gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ -z "${QWZ_WORLD_SIZE:-}" ]; then
  if [ "$gpus" -ge 2 ]; then world="$gpus"; else world=2; fi
else
  world="$QWZ_WORLD_SIZE"
fi
extra=()
[ -n "${QWZ_MIN_SPEEDUP:-}" ] && extra+=(--min-speedup "$QWZ_MIN_SPEEDUP")
failed=0
# The property tests with the long hypothesis profile (2000 examples per property).
python -m pytest -n 2 -m "not multigpu" tests/unit --hypothesis-profile nightly || failed=1
for stage in 1 2; do
  out="$root/$today/stage$stage"
  args=(run --out "$out" --stage "$stage" --group-size 64 --group-size 8192
        --workload "$workload" --ledger "$root/ledger" "${extra[@]}")
  status=0
  if [ "$gpus" -ge "$world" ] && [ "$gpus" -ge 2 ]; then
    # python -m torch.distributed.run: the workers use this venv's interpreter.
    python -m torch.distributed.run --standalone --nproc-per-node "$world" \
      -m qwz.qualify "${args[@]}" || status=$?
  else
    qwz-qualify "${args[@]}" --world-size "$world" || status=$?
  fi
  if [ "$status" -ne 0 ]; then
    echo "nightly: stage $stage qualification failed (exit $status); see $out/report.md" >&2
    failed=1
    continue
  fi
  baseline="$root/qualified/stage$stage/record.json"
  if [ -f "$baseline" ]; then
    status=0
    qwz-qualify compare "$baseline" "$out/record.json" || status=$?
    if [ "$status" -ne 0 ]; then
      echo "nightly: stage $stage compare exit $status against $baseline" >&2
      failed=1
      continue
    fi
  elif [ "${QWZ_NEW_BASELINE:-0}" = "1" ]; then
    echo "nightly: no qualified baseline for stage $stage; QWZ_NEW_BASELINE=1: this run becomes it" >&2
  else
    echo "nightly: no qualified baseline at $baseline (set QWZ_NEW_BASELINE=1 to start one)" >&2
    failed=1
    continue
  fi
  mkdir -p "$root/qualified/stage$stage"
  cp "$out"/* "$root/qualified/stage$stage/"
done
exit "$failed"
