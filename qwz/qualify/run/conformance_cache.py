"""Reusing a conformance table for the same code, where the caller asks for it.

[Note: reused conformance tables]
The conformance table ([Note: conformance run], run/conformance_run.py) depends on the code that
answers it and on nothing a run sets: not the workload, the steps, the arms or the seed. A
process that qualifies the same few subjects many times (the test suite runs about sixty
qualifications) may set ``QWZ_CONFORMANCE_CACHE`` to a directory. A table is then stored there
under a key of everything its child process's answer depends on, and a later run with the same
key takes it instead of starting that child again (four to six seconds each). The CLI says so
on stderr. Unset, which is the default for every user's run and for the nightly, every run asks
its subject.

The key (:func:`key`) binds:

- **the request**: the subject, ``qwz_gather``, ``--deepspeed-src``, every row's config and the
  child's ``sys.path``;
- **the code**: qwz's checkout, by commit and diff digest (the harness, the drop-in's config
  checks and qwz's own parser all live there). For a DeepSpeed subject, also the ``deepspeed``
  package that path imports: its checkout's commit and diff digest, or an installed
  distribution's version and ``RECORD`` (pip's list of every installed file and its hash);
- **the interpreter and the libraries** the messages come from: Python, torch and pydantic;
- **the environment the child reads**: ``PYTHONPATH``, ``DS_*`` and ``QWZ_*`` (all but this
  variable).

Where the code cannot be pinned (qwz outside a git checkout, a ``deepspeed`` that is neither
a git checkout nor an installed distribution), there is no key and the table runs. Only a
table that ran (``error`` null) is stored. A stored file that does not read as a table is run
again and replaced. A reused table is the stored one unchanged, its ``seconds`` included.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import pathlib
import sys
from typing import Any

from qwz.qualify.run import conformance_run

CACHE_ENV = "QWZ_CONFORMANCE_CACHE"
KEY_VERSION = 2
"""Changed whenever what the key covers changes, so no older entry is read."""


def table(
    subject: str,
    *,
    qwz_gather: bool = True,
    deepspeed_src: str | None = None,
    cpu_quantizer: bool = True,
) -> tuple[dict[str, Any], pathlib.Path | None]:
    """The record's ``conformance`` section and, where it was reused, the file it came from
    ([Note: reused conformance tables])."""
    directory = os.environ.get(CACHE_ENV)
    found = None
    if directory:
        found = key(
            subject,
            qwz_gather=qwz_gather,
            deepspeed_src=deepspeed_src,
            cpu_quantizer=cpu_quantizer,
        )
    path = None if found is None else pathlib.Path(directory) / f"{found}.json"
    stored = _load(path) if path is not None else None
    if stored is not None:
        return stored, path
    section = conformance_run.run_table(
        subject, qwz_gather=qwz_gather, deepspeed_src=deepspeed_src, cpu_quantizer=cpu_quantizer
    )
    if path is not None and section["error"] is None:
        from qwz.qualify.base.files import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(section, sort_keys=True))
    return section, None


def key(
    subject: str, *, qwz_gather: bool, deepspeed_src: str | None, cpu_quantizer: bool = True
) -> str | None:
    """The hex digest of everything the table's answer depends on, or None where the code
    cannot be pinned."""
    from qwz.qualify.evidence.rules.conformance import ROWS

    code = {"qwz": _qwz_code()}
    if subject != "qwz":
        code["deepspeed"] = deepspeed_code(_child_path(deepspeed_src))
    if None in code.values():
        return None
    content = {
        "version": KEY_VERSION,
        "subject": subject,
        "qwz_gather": qwz_gather,
        "deepspeed_src": deepspeed_src,
        "cpu_quantizer": cpu_quantizer,
        "rows": [[row.name, row.config] for row in ROWS],
        "sys_path": list(sys.path),
        "code": code,
        "libraries": _libraries(),
        "environment": _environment(),
    }
    text = json.dumps(content, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _load(path: pathlib.Path) -> dict[str, Any] | None:
    """The table stored at `path`, or None when there is none or it is not one."""
    from pydantic import ValidationError

    from qwz.qualify.evidence.schema import Conformance

    try:
        data = json.loads(path.read_text())
        section = Conformance.model_validate(data).model_dump(mode="json")
    except (OSError, ValueError, ValidationError):
        return None
    return section if section["error"] is None and section["rows"] else None


def _qwz_code() -> dict[str, Any] | None:
    from qwz.qualify.evidence.provenance import git_head

    head = git_head()
    return None if head.sha == "unknown" else {"sha": head.sha, "diff": head.diff_sha256}


def _child_path(deepspeed_src: str | None) -> list[str]:
    """The import path the table's child gets (``use_deepspeed_source`` put a source first)."""
    if deepspeed_src is None:
        return list(sys.path)
    return [str(pathlib.Path(deepspeed_src).resolve()), *sys.path]


def deepspeed_code(path: list[str]) -> dict[str, Any] | None:
    """What pins the ``deepspeed`` package `path` imports: its git checkout's commit and diff
    digest, or its installed distribution's version and ``RECORD``; None if neither."""
    from qwz.qualify.evidence.provenance import package_checkout

    spec = importlib.machinery.PathFinder.find_spec("deepspeed", path)
    if spec is None or not spec.submodule_search_locations:
        return None
    package = pathlib.Path(next(iter(spec.submodule_search_locations))).resolve()
    checkout = package_checkout(package)
    if checkout is not None and checkout.sha != "unknown":
        return {"package": str(package), "sha": checkout.sha, "diff": checkout.diff_sha256}
    for found in importlib.metadata.distributions(path=[str(package.parent)]):
        name = (found.metadata["Name"] or "").lower()
        listing = found.read_text("RECORD")
        if name == "deepspeed" and listing:
            digest = hashlib.sha256(listing.encode()).hexdigest()
            return {"package": str(package), "version": found.version, "record": digest}
    return None


def _libraries() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"python": sys.version, "torch": torch.__version__}
    try:
        found["pydantic"] = importlib.metadata.version("pydantic")
    except importlib.metadata.PackageNotFoundError:
        found["pydantic"] = None
    return found


def _environment() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if (name == "PYTHONPATH" or name.startswith(("DS_", "QWZ_"))) and name != CACHE_ENV
    }
