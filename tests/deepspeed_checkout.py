"""A DeepSpeed source checkout to qualify: a copy of the installed ``deepspeed`` package in a
fresh git repository, as ``--deepspeed-src PATH`` takes it (qualify/subjects.py, [Note:
subject identity]).

``make_checkout(tmp_path)`` is stock DeepSpeed at one commit; ``make_checkout(tmp_path,
patch)`` applies the unified diff ``patch`` (paths relative to the checkout's top, e.g.
``a/deepspeed/runtime/zero/config.py``) with ``git apply`` and commits it, so the patched
code is a clean checkout at a commit of its own. The commits are made with a fixed author
and date: the same content gives the same SHA on every machine.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess

GITIGNORE = "__pycache__/\n*.pyc\n*.so\nbuild/\n*.egg-info/\n"
"""What DeepSpeed's own .gitignore keeps out of ``git status``: byte code and build outputs,
which importing and building ops create (they must not make the checkout dirty)."""

_GIT_ENVIRONMENT = {
    "GIT_AUTHOR_NAME": "qwz tests",
    "GIT_AUTHOR_EMAIL": "tests@qwz.invalid",
    "GIT_COMMITTER_NAME": "qwz tests",
    "GIT_COMMITTER_EMAIL": "tests@qwz.invalid",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+0000",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def installed_package() -> pathlib.Path:
    """The installed distribution's ``deepspeed/`` directory (whatever ``sys.path`` says)."""
    located = importlib.metadata.distribution("deepspeed").locate_file("deepspeed")
    package = pathlib.Path(str(located)).resolve()
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"the installed deepspeed distribution has no {package}")
    return package


def git(top: pathlib.Path, *args: str, stdin: str | None = None) -> str:
    """Run git in `top` with the fixed identity; its stdout, or an error naming its stderr."""
    done = subprocess.run(
        ["git", "-C", str(top), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **_GIT_ENVIRONMENT},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {top}: {done.stderr.strip()}")
    return done.stdout.strip()


def make_checkout(tmp_path: pathlib.Path, patch: str | None = None) -> pathlib.Path:
    """A git checkout at ``tmp_path / "ds"`` holding a copy of the installed deepspeed
    package as ``deepspeed/``, committed; with `patch`, that diff applied and committed on
    top. Returns the checkout's top (the PATH of ``--deepspeed-src``)."""
    top = pathlib.Path(tmp_path) / "ds"
    if top.exists():
        raise FileExistsError(f"{top} exists: one checkout per tmp_path")
    shutil.copytree(
        installed_package(), top / "deepspeed", ignore=shutil.ignore_patterns("__pycache__")
    )
    (top / ".gitignore").write_text(GITIGNORE)
    git(top, "init", "-q", "-b", "master")
    git(top, "add", "-A")
    git(top, "commit", "-q", "-m", "stock deepspeed (a copy of the installed package)")
    if patch is not None:
        git(top, "apply", "--whitespace=nowarn", "-", stdin=patch)
        git(top, "add", "-A")
        git(top, "commit", "-q", "-m", "patch")
    return top


def head(top: pathlib.Path) -> str:
    """The checkout's HEAD SHA."""
    return git(top, "rev-parse", "HEAD")
