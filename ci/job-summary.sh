#!/usr/bin/env bash
# The job summary: `bash ci/job-summary.sh TITLE FILE...` appends a "## TITLE" section to
# $GITHUB_STEP_SUMMARY (GitHub Actions renders it on the run's page), or prints it when that
# is unset. A markdown file (a qualification's report.md) goes in as it is; any other file (a
# pytest log) by its last 40 lines in a code block. A missing file is named in the summary:
# the step that should have written it failed or never ran. Always exits 0: whether the job
# failed is the earlier step's exit code, never this summary's.
set -uo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: bash ci/job-summary.sh TITLE [FILE...]" >&2
  exit 2
fi
title="$1"
shift
target="${GITHUB_STEP_SUMMARY:-/dev/stdout}"
{
  echo "## $title"
  echo
  [ "$#" -eq 0 ] && echo "No report was written (the run stopped before any)."
  for file in "$@"; do
    if [ ! -f "$file" ]; then
      echo "\`$file\`: missing (the step that writes it failed or never ran)."
    elif [[ "$file" == *.md ]]; then
      echo "<sub>\`$file\`</sub>"
      echo
      cat "$file"
    else
      echo "\`$file\` (last 40 lines):"
      echo
      echo '```'
      tail -n 40 "$file"
      echo '```'
    fi
    echo
  done
} >> "$target"
exit 0
