"""Temporary git histories for the bisect tests: a copy of this qwz committed as the first
commit, then one commit per edit, so a known commit introduces a known change."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from collections.abc import Callable

QWZ_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "qwz"
BUG_SCALE = (
    "qwz/quant.py",
    "(absmax.to(torch.float64) / INT8_MAX)",
    "(absmax.to(torch.float64) / (INT8_MAX + 1))",
)
"""The mutation suite's ``scale_absmax_over_128`` as a code change: the scale is absmax/128."""
BREAK_IMPORT = ("qwz/quant.py", "import torch\n", "import torch\nimport qwz._no_such_module\n")
"""quant.py imports a module that does not exist: the commit does not import."""

Edit = tuple[str, str, str] | None

_PLANTED_SLEEP = """\
    if any(chunk.row.num_groups for chunk in plan.chunks):  # planted: a step 30% slower
        import time

        period_s = time.perf_counter() - _LAST_QUANTIZED_GATHER_S[0]
        if period_s < 1.0:
            time.sleep(0.3 * period_s)
        _LAST_QUANTIZED_GATHER_S[0] = time.perf_counter()
"""


def SLOW_GATHER(repository: pathlib.Path) -> None:
    """The quantized gather sleeps 30% of the time since the previous one ended (one training
    step without the sleep), so each candidate step takes 30% longer; the reference's gather
    is untouched."""
    path = repository / "qwz" / "collectives.py"
    text = path.read_text()
    anchor = "    collectives = len(plan.chunks) if world_size > 1 else 0\n"
    assert anchor in text and "\n@torch.no_grad()\ndef gather(" in text
    text = text.replace(anchor, _PLANTED_SLEEP + anchor, 1)
    text = text.replace(
        "\n@torch.no_grad()\ndef gather(",
        "\n_LAST_QUANTIZED_GATHER_S = [0.0]\n\n\n@torch.no_grad()\ndef gather(",
        1,
    )
    path.write_text(text)


def git(repository: pathlib.Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repository), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _apply(repository: pathlib.Path, edit: Edit, message: str) -> None:
    if edit is None:  # a commit that changes no code: a note in a docs file
        with open(repository / "NOTES.md", "a") as notes:
            notes.write(f"- {message}\n")
        return
    path, old, new = edit
    target = repository / path
    text = target.read_text()
    assert text.count(old) >= 1, f"{old!r} is not in {path}"
    target.write_text(text.replace(old, new, 1))


def build(
    repository: pathlib.Path,
    commits: list[tuple[str, Edit | Callable[[pathlib.Path], None]]],
) -> list[str]:
    """A repository at `repository` holding this qwz (its first commit) and one commit per
    (message, edit); an edit is (path, old, new), None (a docs note) or a callable of the
    repository's path. The SHAs, oldest first."""
    repository.mkdir(parents=True)
    shutil.copytree(
        QWZ_PACKAGE,
        repository / "qwz",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"),
    )
    (repository / "NOTES.md").write_text("# notes\n")
    git(repository, "init", "--quiet", "--initial-branch=main")
    git(repository, "config", "user.email", "bisect-test@example.invalid")
    git(repository, "config", "user.name", "bisect test")
    git(repository, "add", "-A")
    git(repository, "commit", "--quiet", "-m", "base: a copy of qwz")
    shas = [git(repository, "rev-parse", "HEAD")]
    for message, edit in commits:
        if callable(edit):
            edit(repository)
        else:
            _apply(repository, edit, message)
        git(repository, "add", "-A")
        git(repository, "commit", "--quiet", "-m", message)
        shas.append(git(repository, "rev-parse", "HEAD"))
    return shas


def undo(edit: tuple[str, str, str]) -> tuple[str, str, str]:
    path, old, new = edit
    return path, new, old
