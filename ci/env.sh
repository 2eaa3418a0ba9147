#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install qwz with every
# extra the tests and the qualification need. Sourced by the other ci/ scripts.
#
# torch is installed first and pinned (torch==2.13.0). Where pip is configured with a local
# CPU wheel (as on our CI machines) it takes that. On a stock machine PyPI's Linux wheel is the
# CUDA build; set QWZ_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the CPU one.
# On a GPU machine install the CUDA build of torch into .venv first and set QWZ_KEEP_TORCH=1.
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
    index=()
    [ -n "${QWZ_TORCH_INDEX_URL:-}" ] && index=(--index-url "$QWZ_TORCH_INDEX_URL")
    "$venv/bin/python" -m pip install --quiet "${index[@]}" "torch==2.13.0"
  fi
  "$venv/bin/python" -m pip install --quiet -e "$repo_root[test,deepspeed,qualify,lint]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHONUNBUFFERED=1
# A JIT build of a torch extension (DeepSpeed's CPU comm op) that was killed half-way leaves
# its `lock` file behind, and every later build of that op waits on it forever. No build takes
# 15 minutes, so a lock that old is stale: remove it (it names the op it blocked).
for extensions in "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" "$HOME/.cache/qwz/torch_extensions"; do
  [ -d "$extensions" ] || continue
  find "$extensions" -name lock -type f -mmin +15 -print -delete 2>/dev/null |
    sed 's/^/ci\/env.sh: removed a stale JIT build lock: /' >&2 || true
done
