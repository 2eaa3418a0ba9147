#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install qwz with every
# extra the tests and the qualification need. Sourced by the other ci/ scripts.
#
# torch is installed first and pinned (torch==2.13.0) so pip takes the CPU wheel; on a GPU
# machine install the CUDA build of torch into .venv yourself first and set QWZ_KEEP_TORCH=1.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${QWZ_VENV:-$repo_root/.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$venv/bin/python" ]; then
  echo "ci/env.sh: creating $venv with $python" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
stamp="$venv/.qwz-installed"
want="$(cat "$repo_root/pyproject.toml" "$repo_root/ci/env.sh" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ "${QWZ_KEEP_TORCH:-0}" != "1" ]; then
    "$venv/bin/python" -m pip install --quiet "torch==2.13.0"
  fi
  "$venv/bin/python" -m pip install --quiet -e "$repo_root[test,deepspeed,qualify,lint]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHONUNBUFFERED=1
