"""The review's worktree: one path, both refs checked out there in turn, removed at the end
unless ``--worktree`` named it ([Note: one worktree per review] in
qualify/pr_review/__init__.py); the user's own checkout is never touched."""

from __future__ import annotations

import pathlib

from qwz.qualify.bisect.first_parents import GitError, git


def _common_dir(path: pathlib.Path) -> pathlib.Path:
    """The repository (its common git directory) the checkout at `path` belongs to."""
    return (path / git(path, "rev-parse", "--git-common-dir")).resolve()


def problem(repository: pathlib.Path, worktree: pathlib.Path) -> str | None:
    """Why `worktree` cannot be the review's worktree of `repository`; None if it can: a
    path that does not exist yet, or a worktree of that repository at its top."""
    if not worktree.exists():
        return None
    what = f"--worktree {worktree}: exists and is not a worktree of {repository}"
    if not worktree.is_dir():
        return what
    try:
        top = pathlib.Path(git(worktree, "rev-parse", "--show-toplevel")).resolve()
        same = _common_dir(worktree) == _common_dir(repository)
    except GitError:
        return what
    if not same or top != worktree.resolve():
        return what
    if top == pathlib.Path(git(repository, "rev-parse", "--show-toplevel")).resolve():
        return f"--worktree {worktree}: the repository's own checkout, which a review never touches"
    return None


def check_out(repository: pathlib.Path, worktree: pathlib.Path, sha: str) -> None:
    """`sha` in `worktree`, clean: added as a detached worktree on first use, switched in
    place after (only the files that differ are written, so DeepSpeed's op builds stay valid),
    untracked files that git does not ignore removed."""
    if not worktree.exists():
        worktree.parent.mkdir(parents=True, exist_ok=True)
        git(repository, "worktree", "prune")
        git(repository, "worktree", "add", "--detach", "--force", str(worktree), sha)
        return
    git(worktree, "checkout", "--detach", "--force", sha)
    git(worktree, "clean", "-fd")


def remove(repository: pathlib.Path, worktree: pathlib.Path) -> str | None:
    """Remove `worktree` and its registration in `repository` when it is one of that
    repository's worktrees (:func:`problem` says it can be the review's); else leave it.
    Why it could not be removed, or None."""
    if not worktree.exists() or problem(repository, worktree) is not None:
        return None
    try:
        git(repository, "worktree", "remove", "--force", str(worktree))
        git(repository, "worktree", "prune")
    except GitError as error:
        return str(error)
    return None
