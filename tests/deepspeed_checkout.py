"""A DeepSpeed source checkout for tests: the installed package in a fresh git repository.

``make_checkout(tmp_path, patch)`` copies the installed ``deepspeed`` package (without
``__pycache__``) to ``tmp_path/"DeepSpeed"/"deepspeed"`` beside a ``.gitignore`` for byte
code and builds (as a real checkout has), commits it as "stock", then applies
each patch (unified diffs against that tree, e.g. ``tests/deepspeed_native/proposal.patch``)
with ``git apply`` and commits it. Put the returned root first on ``PYTHONPATH`` (or pass it as
``--deepspeed-src``) and ``import deepspeed`` loads the copy. Author, committer and dates are
fixed, so the same package and patches give the same commit SHA on every run.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
from collections.abc import Sequence

PATCH_DIR = pathlib.Path(__file__).resolve().parent / "deepspeed_native"
"""Where the proposal's patch and its broken variants live."""

GITIGNORE = "__pycache__/\n*.pyc\n*.so\nbuild/\n*.egg-info/\n"
"""What a DeepSpeed checkout ignores (byte code, builds), so importing it leaves it clean."""

_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "qwz tests",
    "GIT_AUTHOR_EMAIL": "tests@qwz.invalid",
    "GIT_COMMITTER_NAME": "qwz tests",
    "GIT_COMMITTER_EMAIL": "tests@qwz.invalid",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+00:00",
}


def installed_package() -> pathlib.Path:
    """The directory of the installed ``deepspeed`` package, found without importing it."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        raise RuntimeError("deepspeed is not installed: the checkout fixture copies its package")
    return pathlib.Path(spec.origin).resolve().parent


def read_patch(name: str) -> str:
    """The text of ``tests/deepspeed_native/<name>.patch``."""
    return (PATCH_DIR / f"{name}.patch").read_text()


def git(root: pathlib.Path, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, **_GIT_IDENTITY, "GIT_CONFIG_GLOBAL": os.devnull}
    done = subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *args],
        cwd=root,
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {root} failed:\n{done.stderr}")
    return done.stdout


def make_checkout(tmp_path: pathlib.Path, patch: str | Sequence[str] | None = None) -> pathlib.Path:
    """A git checkout of the installed DeepSpeed under ``tmp_path/"DeepSpeed"``, with `patch`
    (one diff's text, or several applied in order, one commit each) committed on top of the
    stock commit; returns the checkout root (the directory that holds ``deepspeed/``)."""
    root = pathlib.Path(tmp_path) / "DeepSpeed"
    if root.exists():
        raise FileExistsError(f"{root} exists: make_checkout needs a fresh directory")
    root.mkdir(parents=True)
    shutil.copytree(
        installed_package(),
        root / "deepspeed",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    (root / ".gitignore").write_text(GITIGNORE)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "stock DeepSpeed (the installed package)")
    patches = [patch] if isinstance(patch, str) else list(patch or ())
    for number, text in enumerate(patches, start=1):
        git(root, "apply", "--whitespace=nowarn", "-", stdin=text)
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"patch {number} of {len(patches)}")
    return root


def head(root: pathlib.Path) -> str:
    """The checkout's commit SHA."""
    return git(root, "rev-parse", "HEAD").strip()


Files = dict[str, str]
"""Whole files to write over a checkout: path relative to its root -> text."""


def make_variants(
    tmp_path: pathlib.Path, variants: dict[str, Sequence[str | Files]]
) -> pathlib.Path:
    """One checkout (:func:`make_checkout`, stock) with a branch per entry of `variants`,
    named by its key, holding that entry's changes committed in order on top of stock: a
    unified diff's text is applied, a :data:`Files` mapping written over the tree.
    :func:`use_variant` switches between them. One checkout path for every variant, so
    DeepSpeed builds its ops once (their sources are the same in every variant)."""
    root = make_checkout(tmp_path)
    for name, changes in variants.items():
        git(root, "checkout", "-q", "-b", name, "main")
        for number, change in enumerate(changes, start=1):
            if isinstance(change, str):
                git(root, "apply", "--whitespace=nowarn", "-", stdin=change)
            else:
                for relative, text in change.items():
                    (root / relative).write_text(text)
            git(root, "add", "-A")
            git(root, "commit", "-q", "-m", f"{name}: change {number} of {len(changes)}")
    git(root, "checkout", "-q", "main")
    return root


def use_variant(root: pathlib.Path, name: str) -> str:
    """Check out the branch `name` of a :func:`make_variants` checkout; its commit SHA."""
    git(root, "checkout", "-q", name)
    return head(root)
