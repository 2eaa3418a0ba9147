"""Each tested commit in its own git worktree under ``<out>/worktrees/<sha>``, never the
user's working tree, and the harness snapshot every commit is qualified with ([Note: the
judge is the bisecting head's] in qualify/bisect/__init__.py)."""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import shutil

from qwz.qualify.bisect.first_parents import GitError, git

HARNESS_PACKAGE = pathlib.Path(__file__).resolve().parents[1]
"""``qwz/qualify`` of the qwz running the bisect: the harness every commit is judged by."""


def _harness_files(package: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        path
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def harness_digest(package: pathlib.Path = HARNESS_PACKAGE) -> str:
    """sha256 over the harness's files (relative path and bytes of each)."""
    digest = hashlib.sha256()
    for path in _harness_files(package):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def snapshot_harness(out: pathlib.Path, package: pathlib.Path = HARNESS_PACKAGE) -> pathlib.Path:
    """``<out>/harness/qualify``: a copy of `package` made once (later calls keep the copy;
    request.json holds its digest, compared on resume)."""
    target = out / "harness" / "qualify"
    if not target.is_dir():
        staging = out / "harness" / ".qualify.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(package, staging, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        staging.rename(target)
    return target


def worktree_path(out: pathlib.Path, sha: str) -> pathlib.Path:
    return out / "worktrees" / sha


def check_out(repository: pathlib.Path, out: pathlib.Path, sha: str) -> pathlib.Path:
    """A detached worktree of `sha` at ``<out>/worktrees/<sha>``, made fresh (a leftover
    of an interrupted bisect is removed first: its setup may have been cut short)."""
    path = worktree_path(out, sha)
    remove(repository, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    git(repository, "worktree", "add", "--detach", "--force", str(path), sha)
    return path


def install_harness(worktree: pathlib.Path, snapshot: pathlib.Path) -> bool:
    """Put `snapshot` in place of the worktree's ``qwz/qualify``; False when the commit has
    no ``qwz`` package to put it in (then it cannot be qualified as qwz)."""
    package = worktree / "qwz"
    if not (package / "__init__.py").is_file():
        return False
    shutil.rmtree(package / "qualify", ignore_errors=True)
    shutil.copytree(snapshot, package / "qualify")
    return True


def remove(repository: pathlib.Path, path: pathlib.Path) -> None:
    """Remove the worktree at `path` (and git's note of it), if there is one."""
    if path.exists():
        with contextlib.suppress(GitError):
            git(repository, "worktree", "remove", "--force", "--force", str(path))
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(GitError):
        git(repository, "worktree", "prune")
