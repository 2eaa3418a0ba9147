#!/usr/bin/env bash
# Nightly requalification: stages 1 and 2, group sizes 64 and 8192, into
# <dir>/history/<date>/stage<N>/ (every night is kept), then the regression gate against a
# FIXED baseline per stage in <dir>/baseline/stage<N>/, then the trend of all nights in
# <dir>/trend/ (qwz-qualify history). Exit non-zero on a failed check, a regression, or
# records that cannot be compared.
#
# The baseline never follows the nights: comparing each night with the night before lets a
# 1.5% slowdown a night pass forever. It changes only by a deliberate promotion:
#   QWZ_PROMOTE=1        this run's passing records become the baselines (after review), or
#   qwz-qualify promote <dir>/history/<date>/stage<N>/record.json <dir>/baseline/stage<N>
# QWZ_NEW_BASELINE=1 accepts a run as the first baseline of a stage that has none (without
# it, a missing baseline is a failure: a lost baseline must never turn the gate into a pass).
#
# Environment: QWZ_NIGHTLY_WORKLOAD (default qwen3-tiny; qwen3-0.6b on GPU runners),
# QWZ_NIGHTLY_DIR (default runs/nightly), QWZ_WORLD_SIZE (default: GPU count if >= 2, else 2),
# QWZ_MIN_SPEEDUP (optional lower bound on the speed-up interval), QWZ_BASELINE_DIR
# (default <dir>/baseline; the workflow keeps them in the repository, ci/baselines/nightly),
# QWZ_LEDGER_DIR (default <dir>/ledger), QWZ_RECORD_KEY or QWZ_RECORD_KEY_FILE (sign the
# records; the gate then requires verified signatures). Without a key the night fails at
# once (exit 2) unless QWZ_ALLOW_UNSIGNED=1 says unsigned records are meant.
# Tonight's report paths are listed in <dir>/tonight.txt (the workflow's job summary).
# A stage that fails against a baseline whose commit is known is bisected (ci/nightly-bisect.sh,
# into <dir>/bisect/<date>/stage<N>/; its bisect.md joins tonight.txt); QWZ_NIGHTLY_BISECT=0
# turns that off.
#
# DeepSpeed's own implementation instead of qwz's (README "Requalify a DeepSpeed pull
# request"): QWZ_DEEPSPEED_SRC=PATH (a DeepSpeed checkout) or QWZ_DEEPSPEED_REF=REF (a
# branch, tag, commit or pull/N/head of QWZ_DEEPSPEED_REPO, default DeepSpeed's GitHub
# repository, checked out under <dir>/deepspeed-src/) runs --subject deepspeed-native
# --deepspeed-src on it, into <dir>/history/<date>/deepspeed-native/stage<N>/ against the
# baselines in <dir>/baseline/deepspeed-native/stage<N>/.
set -euo pipefail
cd "$(dirname "$0")/.."
# [Note: signing guard] Checked before anything is installed or run: a night whose records
# nobody can verify must be a decision (QWZ_ALLOW_UNSIGNED=1), never a lost secret.
if [ -z "${QWZ_RECORD_KEY:-}${QWZ_RECORD_KEY_FILE:-}" ]; then
  if [ "${QWZ_ALLOW_UNSIGNED:-0}" != "1" ]; then
    echo "nightly: no signing key: set QWZ_RECORD_KEY or QWZ_RECORD_KEY_FILE, or" \
      "QWZ_ALLOW_UNSIGNED=1 to run unsigned on purpose (the gate then cannot require" \
      "signatures)" >&2
    exit 2
  fi
  echo "nightly: QWZ_ALLOW_UNSIGNED=1: records are unsigned; the gate does not require signatures" >&2
fi
source ci/env.sh
workload="${QWZ_NIGHTLY_WORKLOAD:-qwen3-tiny}"
root="${QWZ_NIGHTLY_DIR:-runs/nightly}"
subject_args=()
subject_dir=""
if [ -n "${QWZ_DEEPSPEED_SRC:-}" ] && [ -n "${QWZ_DEEPSPEED_REF:-}" ]; then
  echo "nightly: set QWZ_DEEPSPEED_SRC or QWZ_DEEPSPEED_REF, not both" >&2
  exit 2
fi
if [ -n "${QWZ_DEEPSPEED_REF:-}" ]; then
  repo="${QWZ_DEEPSPEED_REPO:-https://github.com/deepspeedai/DeepSpeed.git}"
  QWZ_DEEPSPEED_SRC="$root/deepspeed-src/$(printf '%s' "$QWZ_DEEPSPEED_REF" | tr -c 'A-Za-z0-9._-' '_')"
  if [ ! -d "$QWZ_DEEPSPEED_SRC/.git" ]; then
    git clone --quiet "$repo" "$QWZ_DEEPSPEED_SRC"
  fi
  git -C "$QWZ_DEEPSPEED_SRC" fetch --quiet origin "$QWZ_DEEPSPEED_REF"
  git -C "$QWZ_DEEPSPEED_SRC" checkout --quiet --detach FETCH_HEAD
fi
if [ -n "${QWZ_DEEPSPEED_SRC:-}" ]; then
  if [ ! -f "$QWZ_DEEPSPEED_SRC/deepspeed/__init__.py" ]; then
    echo "nightly: QWZ_DEEPSPEED_SRC=$QWZ_DEEPSPEED_SRC holds no deepspeed/ package" >&2
    exit 2
  fi
  echo "nightly: DeepSpeed's own code at $(git -C "$QWZ_DEEPSPEED_SRC" rev-parse HEAD) ($QWZ_DEEPSPEED_SRC)" >&2
  subject_args=(--subject deepspeed-native --deepspeed-src "$QWZ_DEEPSPEED_SRC")
  subject_dir="deepspeed-native/"
fi
today="$(date -u +%Y-%m-%dT%H%M%SZ)"
gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ -z "${QWZ_WORLD_SIZE:-}" ]; then
  if [ "$gpus" -ge 2 ]; then world="$gpus"; else world=2; fi
else
  world="$QWZ_WORLD_SIZE"
fi
extra=()
[ -n "${QWZ_MIN_SPEEDUP:-}" ] && extra+=(--min-speedup "$QWZ_MIN_SPEEDUP")
gate=()
[ -n "${QWZ_RECORD_KEY:-}${QWZ_RECORD_KEY_FILE:-}" ] && gate+=(--require-signature)
baseline_root="${QWZ_BASELINE_DIR:-$root/baseline}"
ledger="${QWZ_LEDGER_DIR:-$root/ledger}"
mkdir -p "$root"
: > "$root/tonight.txt"
failed=0
bisect_night() {  # STAGE OUT RUN-ARGS...: which commit made the stage fail (ci/nightly-bisect.sh)
  local stage="$1" out="$2"
  shift 2
  bash ci/nightly-bisect.sh "$baseline_root/${subject_dir}stage$stage/record.json" \
    "$out/record.json" "$root/bisect/$today/${subject_dir}stage$stage" "$root/tonight.txt" \
    --world-size "$world" "$@"
}
# The property tests with the long hypothesis profile (2000 examples per property).
python -m pytest -n 2 -m "not multigpu" tests/unit --hypothesis-profile nightly || failed=1
for stage in 1 2; do
  out="$root/history/$today/${subject_dir}stage$stage"
  args=(run --out "$out" --stage "$stage" --group-size 64 --group-size 8192
        --workload "$workload" --ledger "$ledger" "${subject_args[@]}" "${extra[@]}")
  echo "$out/report.md" >> "$root/tonight.txt"
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
    bisect_night "$stage" "$out" "${args[@]:3}"
    continue
  fi
  baseline_dir="$baseline_root/${subject_dir}stage$stage"
  if [ -f "$baseline_dir/record.json" ]; then
    status=0
    qwz-qualify compare "${gate[@]}" "$baseline_dir/record.json" "$out/record.json" || status=$?
    if [ "$status" -ne 0 ]; then
      echo "nightly: stage $stage compare exit $status against $baseline_dir/record.json" >&2
      failed=1
      bisect_night "$stage" "$out" "${args[@]:3}"
      continue
    fi
    if [ "${QWZ_PROMOTE:-0}" = "1" ]; then
      echo "nightly: QWZ_PROMOTE=1: promoting stage $stage of $today to the baseline" >&2
      qwz-qualify promote "$out/record.json" "$baseline_dir" || failed=1
    fi
  elif [ "${QWZ_NEW_BASELINE:-0}" = "1" ]; then
    echo "nightly: no baseline for stage $stage; QWZ_NEW_BASELINE=1: this run becomes it" >&2
    qwz-qualify promote "$out/record.json" "$baseline_dir" || failed=1
  else
    echo "nightly: no baseline at $baseline_dir (set QWZ_NEW_BASELINE=1 to start one)" >&2
    failed=1
  fi
done
# The trend of every night kept so far; a record that cannot be loaded fails the job.
qwz-qualify history "$root/history" --out "$root/trend" || failed=1
exit "$failed"
