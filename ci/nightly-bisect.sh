#!/usr/bin/env bash
# Which commit made tonight's stage fail: `qwz-qualify bisect` between the baseline's commit
# (good) and tonight's head (bad), called by ci/nightly.sh when a stage's qualification or its
# gate failed against a baseline whose commit is known.
#
#   bash ci/nightly-bisect.sh BASELINE_RECORD TONIGHT_RECORD OUT TONIGHT_LIST RUN-ARGS...
#   bash ci/nightly-bisect.sh --matrix BASELINE_MATRIX_DIR TONIGHT_MATRIX_DIR OUT TONIGHT_LIST [EXTRA-ARGS...]
#
# --matrix (a night run as `qwz-qualify matrix`): each cell of tonight's matrix.json whose
# status is FAIL is bisected with its own run arguments from its baseline cell's record
# (OUT/<cell id>/); when no cell failed but the gate did, the cells with a baseline are
# bisected with --speed. At most QWZ_NIGHTLY_BISECT_MAX cells (default 2) a night. A cell
# whose failed checks the baseline fails too under today's rules (a judge change:
# qwz/qualify/review/judge_only.py) is not bisected.
#
# RUN-ARGS are the stage's `qwz-qualify run` arguments after `--out DIR`; `--ledger DIR` is
# dropped (a bisect's trials must not write the night's ledger) and `--deepspeed-src PATH`
# becomes the repository bisected (the bisect gives each commit's worktree to the run). The
# oracle: the checks that failed in tonight's record, or, when tonight's record passed and the
# gate still failed (a regression), the speed-up interval. OUT/bisect.md is appended to
# TONIGHT_LIST (the job summary). Never changes the night's exit status: exits 0, and says
# why when it does not bisect (QWZ_NIGHTLY_BISECT=0, the baseline's commit unknown or dirty,
# not in this checkout, or the bisect refused).
set -uo pipefail
if [ "${1:-}" = "--matrix" ]; then
  [ "$#" -ge 5 ] || { echo "usage: bash ci/nightly-bisect.sh --matrix BASELINE_DIR TONIGHT_DIR OUT TONIGHT_LIST [EXTRA-ARGS...]" >&2; exit 2; }
  baseline_dir="$2" tonight_dir="$3" out="$4" list="$5"
  shift 5
  mkdir -p "$out"
  # One line per cell to bisect: its id; its run arguments go NUL-separated into OUT/<id>.args.
  cells="$(python - "$baseline_dir" "$tonight_dir" "$out" "${QWZ_NIGHTLY_BISECT_MAX:-2}" <<'PY'
import json, pathlib, sys
baseline, tonight, out = (pathlib.Path(a) for a in sys.argv[1:4])
most = int(sys.argv[4])
rows = json.loads((tonight / "matrix.json").read_text())["cells"]
known = [row for row in rows if row.get("record") and (baseline / row["record"]).is_file()]
# A failure the baseline shares under today's rules is the judge's, not a commit's: not bisected.
try:
    from qwz.qualify.review.judge_only import classify
    judge_only = {cell: why for cell, only, why in classify(baseline, tonight) if only}
except Exception as error:  # tables or records it cannot read: every FAIL is bisected
    print(f"nightly-bisect: judge-only failures not told apart: {error}", file=sys.stderr)
    judge_only = {}
for cell, why in judge_only.items():
    print(f"nightly-bisect: cell {cell}: judge-only failure ({why}): not bisected", file=sys.stderr)
failed = [row for row in known if row["status"] == "FAIL" and row["id"] not in judge_only]
chosen = failed or [row for row in known if row["status"] == "PASS"]
for row in chosen[:most]:
    (out / f"{row['id']}.args").write_bytes(b"".join(a.encode() + b"\0" for a in row["arguments"]))
    print(row["id"])
PY
)" || cells=""
  for cell in $cells; do
    mapfile -d '' cell_args < "$out/$cell.args"
    bash "$0" "$baseline_dir/cells/$cell/record.json" "$tonight_dir/cells/$cell/record.json" \
      "$out/$cell" "$list" "${cell_args[@]}" "$@"
  done
  [ -n "$cells" ] || echo "nightly-bisect: no cell of $tonight_dir has a baseline record: not bisecting" >&2
  exit 0
fi
if [ "$#" -lt 4 ]; then
  echo "usage: bash ci/nightly-bisect.sh BASELINE_RECORD TONIGHT_RECORD OUT TONIGHT_LIST RUN-ARGS..." >&2
  exit 2
fi
baseline="$1" tonight="$2" out="$3" list="$4"
shift 4
if [ "${QWZ_NIGHTLY_BISECT:-1}" = "0" ]; then
  echo "nightly-bisect: QWZ_NIGHTLY_BISECT=0: not bisecting" >&2
  exit 0
fi
repo=.
run_args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --ledger) shift 2 ;;
    --deepspeed-src) repo="$2"; shift 2 ;;
    *) run_args+=("$1"); shift ;;
  esac
done
# The baseline's head: the commit of the code it qualified (qwz's, or DeepSpeed's).
good="$(python - "$baseline" <<'PY'
import json, sys
head = json.load(open(sys.argv[1])).get("head", {})
sha = head.get("sha") or ""
print("" if sha in ("", "unknown") or head.get("dirty") else sha)
PY
)" || good=""
if [ -z "$good" ] || ! git -C "$repo" cat-file -e "$good^{commit}" 2>/dev/null; then
  echo "nightly-bisect: the baseline $baseline names no clean commit of $repo: not bisecting" >&2
  exit 0
fi
oracle=()
if [ -f "$tonight" ] && python -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["verdict"]["status"] != "PASS")' "$tonight"; then
  oracle=(--speed)  # tonight passed its checks: the gate failed on a regression
fi
bad="$(git -C "$repo" rev-parse HEAD)"
echo "nightly-bisect: bisecting $repo from $good (baseline) to $bad into $out" >&2
status=0
qwz-qualify bisect --repo "$repo" --good "$good" --bad "$bad" --out "$out" "${oracle[@]}" \
  -- "${run_args[@]}" || status=$?
echo "nightly-bisect: qwz-qualify bisect exit $status (0 found, 2 refused or nothing to find, 3 hidden by skipped commits)" >&2
[ -f "$out/bisect.md" ] && echo "$out/bisect.md" >> "$list"
exit 0
