#!/usr/bin/env bash
# The GPU check: on a machine with at least one NVIDIA GPU, install what is needed and run,
# within QWZ_GPU_CHECK_BUDGET_S seconds (default 600, installation not counted):
#   1. the harness at world size 1 on CUDA (PASS, or INCONCLUSIVE with its stated reason);
#   2. the CUDA kernels' bytes against eager/CPU (ci/gpu_checks.py kernel-bytes);
#   3. a 2-buffer gather pipeline whose copies a side stream delays (pipeline);
#   4. a one-rank engine step, bitwise repeatable (engine-repeat);
#   5. the kernels' bandwidth against an HBM copy (benchmarks/gather.py);
#   5b. DeepSpeed's own quantizer op (the PR's CUDA kernel, JIT-built) against the harness's CPU
#      implementation of it, element for element (ci/gpu_checks.py zeropp-op);
#   6. `qwz-qualify review` of the proposal patch as a pull request against the installed
#      DeepSpeed, at world size = the number of GPUs (ci/gpu-review.sh; skipped, with the
#      reason, on one GPU), its claims table copied into the summary;
#   7. `pytest -m multigpu` with the GPUs there are (NCCL where a test's world size fits).
# It writes one summary, $QWZ_GPU_CHECK_OUT/summary.md (default runs/gpu-check).
#
# Exit codes: 0 every check held; 1 a check failed, crashed or ran out of time; 3 no NVIDIA
# GPU here (nothing installed, nothing checked: "skipped"). Not called by .ci/run; CPU CI
# never depends on it.
#
# Installation: the venv of ci/env.sh (QWZ_VENV, default .venv). If its torch cannot see a
# GPU, torch==2.13.0 is installed from QWZ_CUDA_TORCH_INDEX_URL (default: PyPI, whose Linux
# wheel is the CUDA build); ci/env.sh then runs with QWZ_KEEP_TORCH=1 so it keeps that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${QWZ_GPU_CHECK_OUT:-runs/gpu-check}"
budget_s="${QWZ_GPU_CHECK_BUDGET_S:-600}"
mkdir -p "$out"
summary="$out/summary.md"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
fi
if [ "$gpus" -lt 1 ]; then
  message="no GPU: nvidia-smi lists no NVIDIA GPU on $(hostname 2>/dev/null || echo this machine); nothing installed or checked"
  printf '# GPU check\n\n%s (exit 3).\n' "$message" > "$summary"
  echo "ci/gpu-check.sh: $message; exit 3 (skipped). Summary: $summary" >&2
  exit 3
fi

venv="${QWZ_VENV:-$PWD/.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
cuda_probe='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
if ! "$venv/bin/python" -c "$cuda_probe" 2>/dev/null; then
  index=()
  [ -n "${QWZ_CUDA_TORCH_INDEX_URL:-}" ] && index=(--index-url "$QWZ_CUDA_TORCH_INDEX_URL")
  "$venv/bin/python" -m pip install --quiet "${index[@]}" "torch==2.13.0"
fi
export QWZ_VENV="$venv" QWZ_KEEP_TORCH=1
source ci/env.sh
if ! python -c "$cuda_probe"; then
  printf '# GPU check\n\nFAIL: %s GPU(s) listed, but torch %s cannot use CUDA.\n' "$gpus" \
    "$(python -c 'import torch; print(torch.__version__)')" > "$summary"
  echo "ci/gpu-check.sh: torch in $venv cannot use CUDA; see $summary" >&2
  exit 1
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # ci/gpu_checks.py imports tests/
started=$SECONDS
failed=0
{
  echo "# GPU check"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/- GPU: /'
  python -c 'import torch; print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}")'
  echo "- budget ${budget_s} s; head $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| check | outcome | seconds | last line |"
  echo "|---|---|---|---|"
} > "$summary"

# step NAME SECONDS OK_CODES COMMAND...: run COMMAND with a timeout (at most what is left of
# the budget), log it to $out/NAME.log and add a row; an exit code outside OK_CODES fails.
step() {
  local name="$1" limit="$2" ok_codes="$3"
  shift 3
  local left=$((budget_s - (SECONDS - started)))
  [ "$left" -lt "$limit" ] && limit="$left"
  local rc=0 begun=$SECONDS outcome
  if [ "$limit" -le 0 ]; then
    rc=124
    echo "not started: the ${budget_s} s budget is spent" > "$out/$name.log"
  else
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
  fi
  case " $ok_codes " in
    *" $rc "*) outcome="ok (exit $rc)" ;;
    *) outcome="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit} s"))"; failed=1 ;;
  esac
  local last
  last="$(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | tr '|' '/' | cut -c1-240)"
  echo "| $name | $outcome | $((SECONDS - begun)) | $last |" >> "$summary"
  echo "ci/gpu-check.sh: $name: $outcome" >&2
}

# 1. Harness, one rank on CUDA: PASS (0) or INCONCLUSIVE (3); the verdict's reason is the
#    log's last line.
harness() {
  local rc=0
  qwz-qualify run --world-size 1 --workload mlp --steps 6 --blocks 2 --block-steps 2 \
    --warmup-steps 1 --out "$out/qualify" --force --allow-one-rank || rc=$?
  python -c 'import sys; from qwz.qualify.evidence import record
r = record.load(sys.argv[1]); print(f"verdict {r.verdict.status}: {r.verdict}")' \
    "$out/qualify/record.json" || true
  return "$rc"
}
export -f harness
export out
step harness-w1-cuda 150 "0 3" bash -c harness
step kernel-bytes 60 "0" python ci/gpu_checks.py kernel-bytes --device cuda
step pipeline-delayed-copies 60 "0" python ci/gpu_checks.py pipeline --device cuda
step engine-repeatable 60 "0" python ci/gpu_checks.py engine-repeat --device cuda
bench_args=(--numels 16777216 67108864 --group-sizes 64 8192 --repeats 3)
if [ "$gpus" -ge 2 ]; then bench_args+=(--world-sizes "$gpus"); else bench_args+=(--skip-gather); fi
step bandwidth-vs-hbm-copy 90 "0" python benchmarks/gather.py "${bench_args[@]}"
step zeropp-op-vs-cpu 240 "0" python ci/gpu_checks.py zeropp-op --device cuda
step "review-w${gpus}" 300 "0" bash ci/gpu-review.sh "$out/review" "$gpus"
step "multigpu-suite-${gpus}gpu" 600 "0" python -m pytest -m multigpu tests/multigpu -x -q

if [ -f "$out/review/claims.md" ]; then
  { echo; echo "### Review of the proposal patch against the installed DeepSpeed (W=$gpus)"
    echo; sed 's/^## Claims$//' "$out/review/claims.md"; } >> "$summary"
fi
{
  echo
  echo "Logs: $out/*.log. Benchmark tables: $out/bandwidth-vs-hbm-copy.log."
  echo "Total $((SECONDS - started)) s; $([ "$failed" -eq 0 ] && echo 'every check held' || echo 'FAILED')."
} >> "$summary"
echo "ci/gpu-check.sh: summary in $summary" >&2
exit "$failed"
