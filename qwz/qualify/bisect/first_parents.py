"""The git side of a bisect: commits by SHA, the first-parent range, subjects and diff stats.

Every call is ``git -C <repository> ...``; nothing here writes to the repository."""

from __future__ import annotations

import pathlib
import subprocess

GIT_TIMEOUT_S = 120.0


class GitError(RuntimeError):
    """A git command failed; the message names the command and git's own words."""


def git(repository: pathlib.Path, *args: str) -> str:
    """The standard output of ``git -C repository ARGS`` (stripped); raises GitError."""
    command = ["git", "-C", str(repository), *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise GitError(f"{' '.join(command)}: {error}") from None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise GitError(f"{' '.join(command)}: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout.rstrip()


def top_level(repository: pathlib.Path) -> pathlib.Path:
    """The root of the git checkout holding `repository`; raises GitError if none."""
    return pathlib.Path(git(repository, "rev-parse", "--show-toplevel"))


def commit_sha(repository: pathlib.Path, revision: str) -> str:
    """The full SHA of the commit `revision` names; raises GitError if it names none."""
    if revision.startswith("-"):
        raise GitError(f"{revision!r} is not a revision (it starts with '-')")
    return git(repository, "rev-parse", "--verify", "--quiet", "--end-of-options",
               f"{revision}^{{commit}}")  # fmt: skip


def first_parent_range(repository: pathlib.Path, good: str, bad: str) -> list[str]:
    """[good, c1, ..., bad]: the first-parent chain from `good` to `bad`, oldest first.

    Raises GitError unless `good` is an ancestor of `bad` on that chain (a bisect walks one
    line of history; a `good` reached only through a merged branch has no place on it)."""
    if good == bad:
        raise GitError(f"the good and the bad commit are the same ({good[:12]})")
    after = git(repository, "rev-list", "--first-parent", "--reverse", f"{good}..{bad}")
    chain = after.split()
    if not chain:
        raise GitError(f"{bad[:12]} does not come after {good[:12]}: nothing lies between them")
    first_parent = git(repository, "rev-parse", f"{chain[0]}^1") if chain else ""
    if first_parent != good:
        raise GitError(
            f"{good[:12]} is not on the first-parent history of {bad[:12]} (the first "
            f"commit after it on that line, {chain[0][:12]}, has parent {first_parent[:12]})"
        )
    return [good, *chain]


def subject_line(repository: pathlib.Path, sha: str) -> str:
    return git(repository, "log", "-1", "--format=%s", sha)


def diff_stat(repository: pathlib.Path, sha: str) -> str:
    """``git show --stat`` of `sha` against its first parent (a merge too): the files and
    lines it changed."""
    return git(repository, "show", "--first-parent", "--format=", "--stat", sha)
