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
from typing import NamedTuple

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


class Edit(NamedTuple):
    """One line (or block) of a checkout's file replaced: `old` must occur exactly once."""

    path: str
    old: str
    new: str

    def apply(self, root: pathlib.Path) -> None:
        target = root / self.path
        text = target.read_text()
        if text.count(self.old) != 1:
            raise ValueError(f"{self.path}: {self.old!r} occurs {text.count(self.old)} times")
        target.write_text(text.replace(self.old, self.new))


Change = str | Files | Edit
"""A unified diff's text, whole files, or an edit of one file."""


def make_variants(tmp_path: pathlib.Path, variants: dict[str, Sequence[Change]]) -> pathlib.Path:
    """One checkout (:func:`make_checkout`, stock) with a branch per entry of `variants`,
    named by its key, holding that entry's changes committed in order on top of stock: a
    unified diff's text is applied, a :data:`Files` mapping written over the tree, an
    :class:`Edit` made.
    :func:`use_variant` switches between them. One checkout path for every variant, so
    DeepSpeed builds its ops once (their sources are the same in every variant)."""
    root = make_checkout(tmp_path)
    for name, changes in variants.items():
        git(root, "checkout", "-q", "-b", name, "main")
        for number, change in enumerate(changes, start=1):
            if isinstance(change, str):
                git(root, "apply", "--whitespace=nowarn", "-", stdin=change)
            elif isinstance(change, Edit):
                change.apply(root)
            else:
                for relative, text in change.items():
                    (root / relative).parent.mkdir(parents=True, exist_ok=True)
                    (root / relative).write_text(text)
            git(root, "add", "-A")
            git(root, "commit", "-q", "-m", f"{name}: change {number} of {len(changes)}")
    git(root, "checkout", "-q", "main")
    return root


def use_variant(root: pathlib.Path, name: str) -> str:
    """Check out the branch `name` of a :func:`make_variants` checkout; its commit SHA."""
    git(root, "checkout", "-q", name)
    return head(root)


NATIVE_BROKEN = (
    "broken_scale_128",
    "broken_group_size_64",
    "broken_owner_exact",
    "broken_small_quantized",
)
"""The broken variants of ``proposal.patch``: ``tests/deepspeed_native/<name>.patch`` on top."""

CONFORMANCE_BROKEN = (
    "broken_group_size_multiple_of_4",
    "broken_stage3_group_size",
    "broken_fp32_accepted",
)
"""Variants of ``proposal.patch`` that break one of the PR's config rules (a group size of 12
accepted, a non-default size accepted with ZeRO-3, fp32 with quantized weights accepted):
what ``conformance`` must FAIL (tests/multigpu/test_conformance.py); their gather is the
proposal's."""


def every_variant() -> dict[str, list[Change]]:
    """The changes of every variant the multigpu tests check out, for :func:`make_variants`:
    the proposal, each of :data:`NATIVE_BROKEN` and :data:`CONFORMANCE_BROKEN` on top of it, and
    each module of the corpus (``tests/deepspeed_native/corpus/``) over the proposal. The
    ``main`` branch is stock.

    [Note: one DeepSpeed checkout per worker]
    DeepSpeed JIT-builds its CPU comm op for each checkout path ([Note: ops of a checkout],
    qwz/qualify/run/subjects.py), which takes two to five minutes on 2 cores. One checkout with
    a branch per variant (the ``deepspeed_variants`` fixture of tests/multigpu/conftest.py,
    one per xdist worker) builds it once per worker instead of once per test module. The tests
    of one worker run one after another and each checks out its branch before using it."""
    from tests.deepspeed_native import corpus

    proposal = read_patch("proposal")
    variants: dict[str, list[Change]] = {"proposal": [proposal]}
    variants |= {name: [proposal, read_patch(name)] for name in NATIVE_BROKEN}
    variants |= {name: [proposal, read_patch(name)] for name in CONFORMANCE_BROKEN}
    for name in (*corpus.FREEDOMS, *corpus.BROKEN, *corpus.WHOLE_BROKEN):
        assert name not in variants, f"two variants named {name}"
        variants[name] = [proposal, {corpus.MODULE: corpus.module_text(name)}]
    for name in (*corpus.PR8511, *corpus.PR8511_BROKEN):
        assert name not in variants, f"two variants named {name}"
        variants[name] = corpus.pr8511_changes(name)
    return variants


# ------------------------------------------------------ checkouts from source distributions
SDIST_SHA256 = {
    "0.19.6": "31593acffbe4794c74446094122b1bc29d8c73a137e37aff899ca4a6480df2d8",
    "0.19.8": "9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af",
}
"""sha256 of DeepSpeed's source distributions as downloaded from the package registry: a
download that differs is refused, never unpacked."""

BUILD_GENERATED = ("deepspeed/git_version_info_installed.py", "deepspeed.egg-info", "PKG-INFO")
"""What the sdist has and a git clone does not: ``setup.py``'s install-time version file (with
it DeepSpeed reports its version from anywhere; without it, only from the checkout's root)
and the packaging metadata."""


class SdistUnavailable(RuntimeError):
    """The registry cannot be reached and no copy of the sdist is cached: tests skip."""


def _cache_dir() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "qwz"


def _sha256(path: pathlib.Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_sdist(version: str) -> pathlib.Path:
    """DeepSpeed `version`'s source distribution, from ``~/.cache/qwz/sdists/<version>/`` or
    downloaded there with ``pip download --no-deps --no-binary :all:``; its sha256 must be
    :data:`SDIST_SHA256`'s. Raises :class:`SdistUnavailable` when it is neither cached nor
    downloadable."""
    import sys
    import tempfile

    expected = SDIST_SHA256.get(version)
    if expected is None:
        raise ValueError(
            f"version: {version!r} has no pinned sha256; pin one of {list(SDIST_SHA256)}"
        )
    directory = _cache_dir() / "sdists" / version
    cached = directory / f"deepspeed-{version}.tar.gz"
    if not cached.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as download:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--no-build-isolation", "-d", download, f"deepspeed=={version}"],
                capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            found = sorted(pathlib.Path(download).glob("deepspeed-*.tar.gz"))
            if done.returncode != 0 or not found:
                said = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise SdistUnavailable(
                    f"DeepSpeed {version}'s sdist is not cached in {directory} and pip download "
                    f"failed (exit {done.returncode}): {said}"
                )
            found[0].replace(cached)
    actual = _sha256(cached)
    if actual != expected:
        raise RuntimeError(
            f"{cached}: sha256 {actual}, not the pinned {expected}; remove it to download again"
        )
    return cached


def sdist_checkout(version: str) -> pathlib.Path:
    """A git checkout of DeepSpeed `version` as a user has one: its source distribution
    (:func:`fetch_sdist`) unpacked into a git repository without :data:`BUILD_GENERATED`
    (so, like a clone, it reports "0.0.0" unless imported from its root), committed as
    "stock". Built once under ``~/.cache/qwz/checkouts/`` (a fixed path, so DeepSpeed's JIT
    ops are built once, [Note: ops of a checkout]) and rebuilt when it is not clean; the
    fixed author and dates give the same commit SHA on every machine. Two test processes
    asking at once (pytest-xdist's workers) take turns: the second finds the first's."""
    import fcntl

    root = _cache_dir() / "checkouts" / f"DeepSpeed-{version}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"DeepSpeed-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _sdist_checkout(version, root)


def _sdist_checkout(version: str, root: pathlib.Path) -> pathlib.Path:
    import tarfile
    import tempfile

    if root.is_dir():
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if status.returncode == 0 and not status.stdout.strip():
            return root
        shutil.rmtree(root)
    archive = fetch_sdist(version)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        [unpacked] = pathlib.Path(scratch).iterdir()
        for name in BUILD_GENERATED:
            generated = unpacked / name
            if generated.is_dir():
                shutil.rmtree(generated)
            elif generated.exists():
                generated.unlink()
        (unpacked / ".gitignore").write_text(GITIGNORE)
        git(unpacked, "init", "-q")
        git(unpacked, "add", "-A")
        git(unpacked, "commit", "-q", "-m", f"DeepSpeed {version} (its source distribution)")
        unpacked.rename(root)
    return root
