#!/usr/bin/env bash
# Nightly requalification: a matrix spec (qwz-qualify matrix, qwz/qualify/matrix/) into
# <dir>/history/<date>/<spec>/ (every night is kept), then the regression gate, cell by
# cell, against a FIXED baseline matrix in <dir>/baseline/<spec>/ (qwz-qualify compare of
# two matrix directories), then the trend of all nights in <dir>/trend/ (qwz-qualify
# history). Exit non-zero on a failed, crashed or inconclusive cell, a regression (a cell
# whose check regressed, or a baseline cell with no record tonight), or matrices that cannot
# be compared.
#
# The spec: QWZ_NIGHTLY_SPEC (default specs/nightly.toml: qwen3-tiny, stages 1 and 2, group
# sizes 64 and 8192; the GPU workflow names specs/nightly-gpu.toml). <spec> above is its
# file name without .toml, so each spec has its own history and baseline.
#
# The baseline never follows the nights: comparing each night with the night before lets a
# 1.5% slowdown a night pass forever. It changes only by a deliberate promotion:
#   QWZ_PROMOTE=1        this run's matrix becomes the baseline (after review) when every
#                        cell that ran passed and the gate found no regression, or
#   qwz-qualify promote --force <dir>/history/<date>/<spec> <dir>/baseline/<spec>
# QWZ_NEW_BASELINE=1 accepts a passing run as the first baseline of a spec that has none
# (without it, a missing baseline is a failure: a lost baseline must never turn the gate
# into a pass).
#
# Environment: QWZ_NIGHTLY_SPEC, QWZ_NIGHTLY_DIR (default runs/nightly), QWZ_MIN_SPEEDUP
# (optional lower bound on every cell's speed-up interval), QWZ_BASELINE_DIR (default
# <dir>/baseline; the workflow keeps them in the repository, ci/baselines/nightly),
# QWZ_LEDGER_DIR (default <dir>/ledger), QWZ_RECORD_KEY or QWZ_RECORD_KEY_FILE (sign the
# records; the gate then requires verified signatures). Without a key the night fails at
# once (exit 2) unless QWZ_ALLOW_UNSIGNED=1 says unsigned records are meant. World sizes
# are the spec's: every cell runs local ranks (NCCL where the GPUs cover its world size).
# Tonight's table is listed in <dir>/tonight.txt (the workflow's job summary).
# A matrix that fails, or fails the gate, against a baseline matrix whose commit is known is
# bisected cell by cell (ci/nightly-bisect.sh --matrix, into <dir>/bisect/<date>/; each
# bisect.md joins tonight.txt); QWZ_NIGHTLY_BISECT=0 turns that off.
#
# A changed judge is not a regression ([Note: rejudging], qwz/qualify/evidence/rejudge.py):
# compare judges the baseline and tonight by today's rules, and every "judge changed: ..."
# line it prints goes to <dir>/judge.md (listed in tonight.txt, so the job summary says it).
# A night whose failed cells the baseline fails too under today's rules (python -m
# qwz.qualify.review.judge_only: the judge changed, not the code) exits 0 and bisects
# nothing; a failure the baseline does not share still fails the night and is bisected.
# QWZ_NIGHTLY_TESTS=0 skips the property tests and the multigpu tests marked nightly
# (ci/nightly-judge-change.sh);
# QWZ_MEMORY_GROWTH_PCT sets compare's --memory-growth-pct (CPU RSS is noisy: README).
#
# DeepSpeed's own implementation instead of qwz's (README "Requalify a DeepSpeed pull
# request"): QWZ_DEEPSPEED_SRC=PATH (a DeepSpeed checkout) or QWZ_DEEPSPEED_REF=REF (a
# branch, tag, commit or pull/N/head of QWZ_DEEPSPEED_REPO, default DeepSpeed's GitHub
# repository, checked out under <dir>/deepspeed-src/) runs a --subject deepspeed-native spec
# (default specs/nightly-deepspeed-native.toml) with --deepspeed-src on it, into
# <dir>/history/<date>/deepspeed-native/<spec>/ against <dir>/baseline/deepspeed-native/<spec>/.
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
  subject_args=(--deepspeed-src "$QWZ_DEEPSPEED_SRC")  # the spec names the subject
  subject_dir="deepspeed-native/"
fi
today="$(date -u +%Y-%m-%dT%H%M%SZ)"
if [ -n "$subject_dir" ]; then default_spec=specs/nightly-deepspeed-native.toml; else default_spec=specs/nightly.toml; fi
spec="${QWZ_NIGHTLY_SPEC:-$default_spec}"
spec_name="$(basename "$spec" .toml)"
extra=()
[ -n "${QWZ_MIN_SPEEDUP:-}" ] && extra+=(--min-speedup "$QWZ_MIN_SPEEDUP")
gate=()
[ -n "${QWZ_RECORD_KEY:-}${QWZ_RECORD_KEY_FILE:-}" ] && gate+=(--require-signature)
[ -n "${QWZ_MEMORY_GROWTH_PCT:-}" ] && gate+=(--memory-growth-pct "$QWZ_MEMORY_GROWTH_PCT")
baseline_root="${QWZ_BASELINE_DIR:-$root/baseline}"
ledger="${QWZ_LEDGER_DIR:-$root/ledger}"
mkdir -p "$root"
: > "$root/tonight.txt"
failed=0
bisect_night() {  # which commit made tonight's matrix fail (ci/nightly-bisect.sh --matrix)
  bash ci/nightly-bisect.sh --matrix "$baseline_dir" "$out" "$root/bisect/$today/${subject_dir}$spec_name" \
    "$root/tonight.txt" "${subject_args[@]}"
}
# The property tests with the long hypothesis profile (2000 examples per property).
if [ "${QWZ_NIGHTLY_TESTS:-1}" != "0" ]; then
  # QWZ_NIGHTLY_TESTS=1: the unit tests marked nightly too (the compile cache's second order).
  QWZ_NIGHTLY_TESTS=1 python -m pytest -n 2 -m "not multigpu" tests/unit --hypothesis-profile nightly || failed=1
  # The multigpu tests marked nightly (every corpus variant at world sizes 2 and 4, ...),
  # which the test command deselects.
  QWZ_NIGHTLY_TESTS=1 python -m pytest -n 2 --dist loadfile -m nightly tests/multigpu || failed=1
fi
out="$root/history/$today/${subject_dir}$spec_name"
echo "$out/matrix.md" >> "$root/tonight.txt"
status=0
qwz-qualify matrix "$spec" --out "$out" --ledger "$ledger" "${subject_args[@]}" "${extra[@]}" \
  || status=$?
if [ "$status" -eq 2 ]; then
  echo "nightly: the matrix refused $spec (exit 2)" >&2
  exit 2
fi
if [ "$status" -ne 0 ]; then
  echo "nightly: the matrix of $spec did not pass (exit $status); see $out/matrix.md" >&2
fi
baseline_dir="$baseline_root/${subject_dir}$spec_name"
judge="$root/judge.md"
rm -f "$judge"
if [ -f "$baseline_dir/matrix.json" ]; then
  gated=0
  qwz-qualify compare "${gate[@]}" "$baseline_dir" "$out" > "$root/compare.txt" || gated=$?
  cat "$root/compare.txt"
  if grep -q "judge changed: " "$root/compare.txt"; then
    { echo "# judge changed since the baseline"; echo
      echo "The baseline's records were judged by other rule versions than tonight's; both"
      echo "sides are gated by today's rules (compare), so these are not regressions:"; echo
      grep "judge changed: " "$root/compare.txt" | sed 's/^/- /'; } > "$judge"
    echo "$judge" >> "$root/tonight.txt"
    echo "nightly: judge changed: $(grep -c "judge changed: " "$root/compare.txt") lines; see $judge" >&2
  fi
  if [ "$gated" -ne 0 ]; then
    echo "nightly: compare exit $gated against the baseline matrix $baseline_dir" >&2
    failed=1
    bisect_night
  elif [ "$status" -ne 0 ]; then
    explained=0
    python -m qwz.qualify.review.judge_only "$baseline_dir" "$out" > "$root/judge-only.txt" \
      || explained=$?
    cat "$root/judge-only.txt" >&2
    if [ "$explained" -eq 0 ] && [ -s "$root/judge-only.txt" ]; then
      { [ -f "$judge" ] || echo "# judge changed since the baseline"; echo
        echo "judge changed: every cell that did not pass tonight fails the baseline under"
        echo "today's rules too (the judge changed, not the code): no regression, no bisect"; echo
        sed 's/^/- /' "$root/judge-only.txt"; } >> "$judge"
      grep -qxF "$judge" "$root/tonight.txt" || echo "$judge" >> "$root/tonight.txt"
      echo "nightly: judge changed: tonight's failures are the baseline's under today's rules; not failing the night" >&2
    else
      failed=1
      bisect_night
    fi
  elif [ "${QWZ_PROMOTE:-0}" = "1" ]; then
    echo "nightly: QWZ_PROMOTE=1: promoting $spec_name of $today to the baseline" >&2
    qwz-qualify promote --force "$out" "$baseline_dir" || failed=1
  fi
elif [ "${QWZ_NEW_BASELINE:-0}" = "1" ]; then
  if [ "$status" -ne 0 ]; then failed=1; fi
  echo "nightly: no baseline for $spec_name; QWZ_NEW_BASELINE=1: this run becomes it" >&2
  qwz-qualify promote "$out" "$baseline_dir" || failed=1
else
  if [ "$status" -ne 0 ]; then failed=1; fi
  echo "nightly: no baseline at $baseline_dir (set QWZ_NEW_BASELINE=1 to start one)" >&2
  failed=1
fi
# The trend of every night kept so far; a record that cannot be loaded fails the job.
qwz-qualify history "$root/history" --out "$root/trend" || failed=1
exit "$failed"
