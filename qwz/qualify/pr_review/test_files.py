"""Which of the PR's files are its own tests ([Note: the PR's own tests] in
qualify/pr_review/own_tests.py): what ``git diff base...head`` adds or changes under
``tests/``, or the files ``--pr-tests`` names where the diff cannot tell (a squashed base)."""

from __future__ import annotations

import pathlib
from typing import NamedTuple

from qwz.qualify.bisect.first_parents import GitError, git

TESTS_DIR = "tests/"
"""Where DeepSpeed keeps its tests (``tests/conftest.py``, ``tests/unit/common.py``)."""


class TestFiles(NamedTuple):
    how: str
    """"git diff BASE...HEAD" or "--pr-tests"."""
    tests: tuple[str, ...]
    """The test files to run, relative to the repository's root."""
    others: tuple[str, ...]
    """Other files the PR adds or changes under ``tests/`` (helpers, conftest, data): part of
    its tests, never run on their own."""

    @property
    def changed(self) -> tuple[str, ...]:
        return (*self.tests, *self.others)


def is_test_file(path: str) -> bool:
    """pytest's default test module names (``test_*.py``, ``*_test.py``) under ``tests/``."""
    name = pathlib.PurePosixPath(path).name
    return (
        path.startswith(TESTS_DIR)
        and name.endswith(".py")
        and (name.startswith("test_") or name.endswith("_test.py"))
    )


def from_diff(repository: pathlib.Path, base: str, head: str) -> TestFiles:
    """The files the PR adds or changes under ``tests/``, as its pull request shows them (from
    the commit where it left the base); ValueError when the two share no history."""
    try:
        changed = git(
            repository,
            "diff",
            "--name-only",
            "--diff-filter=d",
            f"{base}...{head}",
            "--",
            TESTS_DIR,
        )
    except GitError:
        raise ValueError(
            f"{base[:12]} and {head[:12]} share no history, so the diff cannot tell the PR's "
            "tests: name them with --pr-tests PATH..., or pass --no-pr-tests"
        ) from None
    paths = [path for path in changed.splitlines() if path]
    tests = tuple(path for path in paths if is_test_file(path))
    others = tuple(path for path in paths if not is_test_file(path))
    return TestFiles(f"git diff {base[:12]}...{head[:12]} -- {TESTS_DIR}", tests, others)


def exists_at(repository: pathlib.Path, sha: str, path: str) -> bool:
    """Whether `path` is a file of the commit `sha`."""
    try:
        return git(repository, "cat-file", "-t", f"{sha}:{path}") == "blob"
    except GitError:
        return False


def from_paths(repository: pathlib.Path, head: str, paths: list[str]) -> TestFiles:
    """The files ``--pr-tests`` names (relative to the repository's root); ValueError naming
    each that is no file of the head."""
    named = [pathlib.PurePosixPath(path).as_posix().removeprefix("./") for path in paths]
    missing = [path for path in named if not exists_at(repository, head, path)]
    if missing:
        raise ValueError(
            "\n".join(
                f"--pr-tests {path} is not a file of the head {head[:12]}" for path in missing
            )
        )
    return TestFiles("--pr-tests", tuple(dict.fromkeys(named)), ())
