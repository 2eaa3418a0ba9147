"""Checkpoints of qwz's engine: one file per rank plus a manifest, written atomically.

[Note: checkpoint layout]
A checkpoint is a directory::

    rank00000.pt ... rankNNNNN.pt   one per rank of the data-parallel group (torch.save)
    manifest.json                   written last, by group rank 0

A rank file holds what only that rank has: the state its target returns from
``state_dict()`` (for qwz's engine, ``Engine.state_dict``: its fp32 master shards and the
torch optimizer state of those shards, the module state the optimizer does not own --
frozen parameters and buffers: BatchNorm statistics may differ per rank, as in DeepSpeed
-- and the engine's counters and loss-scale state) and the layout it belongs to.

The manifest names the layout the shards belong to (world size, stage, dtype, group
size, whether the gather quantizes), the step counters, the size and sha256 of every
rank file, the parameter hash of the working weights and of each rank's masters, and
a ``digest``: the sha256 of the canonical JSON of everything else in it, so an edited or
truncated manifest is refused like a damaged rank file.

[Note: resume from the masters]
The working weights after a quantized gather are a lossy copy of the fp32 masters;
rebuilding masters from them (``module.state_dict()``) would make the int8 error
permanent. So a checkpoint stores the masters, and loading restores them bit for bit
and re-gathers every working copy from them: since the gather is a deterministic
function of the masters, the resumed run's weights, and every later step, are bit for
bit those of the uninterrupted run.

Writing: rank 0 first removes any old manifest, so a checkpoint interrupted half-way
has none and is refused as incomplete. Every file is written to a temporary name,
flushed to disk and renamed into place (``os.replace``); the manifest is written only
after every rank has written its file, and every rank returns only after it exists.

Loading is all or nothing: every rank checks the manifest against its target's layout, its
own file against the manifest's sha256, and the decoded state with the target's
``check_state_dict``; the ranks then exchange verdicts, and only when every rank can load
does any rank call ``load_state_dict``. Otherwise every rank raises the same
:class:`CheckpointError`, naming each rank's reason.

[Note: checkpoint target]
This module owns the files, the manifest and the vote, and nothing else: it never imports
the engine. What it saves and restores is a *target* in the ``Stateful`` shape of torch's
distributed checkpoint (``state_dict()`` / ``load_state_dict()``, plus
``check_state_dict()`` that raises ValueError without changing anything), described by a
:class:`Target`: the state's owner, the layout fields loading requires to match and the
rank's group; :func:`save` also takes the manifest's summary fields.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from qwz.jsonio import JsonInputError, read_json_file

FORMAT = "qwz-checkpoint/2"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; nothing was loaded. The message names the
    directory and what was wrong (on which rank)."""


class Stateful(Protocol):
    """What a checkpoint saves and restores ([Note: checkpoint target])."""

    def state_dict(self) -> dict[str, Any]: ...

    def check_state_dict(self, state: dict[str, Any]) -> None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Group:
    """The target's data-parallel group, with the collectives skipped on one rank."""

    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.process_group)

    def all_gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.process_group)
        return gathered


@dataclass(frozen=True)
class Target:
    """One rank's side of a checkpoint ([Note: checkpoint target])."""

    state: Stateful
    """Saved with ``state_dict()``; restored with ``load_state_dict()`` after every rank's
    ``check_state_dict()`` accepted its file."""
    layout: Mapping[str, Any]
    """What the shards depend on (JSON values); loading requires every field to match."""
    group: Group


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _digest(fields: dict[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save(
    target: Target,
    directory: str | os.PathLike[str],
    *,
    summary: Mapping[str, Any],
    rank_summary: Mapping[str, Any],
) -> pathlib.Path:
    """Write `target`'s checkpoint into `directory` (created if needed); every rank of the
    target's group must call this. Returns the manifest's path. See [Note: checkpoint layout].
    `summary`: manifest fields written by group rank 0 after the layout; `rank_summary`: this
    rank's fields of its manifest entry, beside the file's name, size and sha256 (JSON
    values). A RuntimeError from ``state_dict()`` (state that cannot be saved now) is a
    CheckpointError."""
    group = target.group
    root = pathlib.Path(directory)
    manifest_path = root / MANIFEST
    try:
        state = target.state.state_dict()
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {root}: {error}") from None
    payload = {"format": FORMAT, "rank": group.rank, "layout": dict(target.layout), **state}
    root.mkdir(parents=True, exist_ok=True)
    if group.rank == 0:
        manifest_path.unlink(missing_ok=True)
    group.barrier()

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    name = rank_file_name(group.rank)
    _write_atomically(root / name, data)
    files = group.all_gather(
        {
            "rank": group.rank,
            "name": name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            **rank_summary,
        }
    )
    if group.rank == 0:
        fields = {"format": FORMAT, **target.layout, **summary, "files": files}
        manifest = {**fields, "digest": _digest(fields)}
        _write_atomically(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())
    group.barrier()
    return manifest_path


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint in `directory`, its digest checked."""
    root = pathlib.Path(directory)
    path = root / MANIFEST
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {root}: no {MANIFEST} (not a qwz checkpoint, or its save was "
            "interrupted before every rank had written its file)"
        )
    try:
        manifest = read_json_file(path, what="checkpoint manifest")
    except JsonInputError as error:
        raise CheckpointError(f"checkpoint {root}: {MANIFEST} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {root}: format {found!r}, expected {FORMAT!r}")
    fields = {key: value for key, value in manifest.items() if key != "digest"}
    if manifest.get("digest") != _digest(fields):
        raise CheckpointError(
            f"checkpoint {root}: {MANIFEST} does not match its digest (edited or corrupt)"
        )
    return manifest


def _check_layout(root: pathlib.Path, manifest: dict[str, Any], layout: Mapping[str, Any]) -> None:
    for key, here in layout.items():
        saved = manifest.get(key)
        if saved != here:
            raise CheckpointError(
                f"checkpoint {root}: {key} is {saved!r} in the checkpoint but {here!r} in "
                "this engine; a qwz checkpoint holds per-rank shards of one layout and loads "
                "only into an engine with the same world size, stage, dtype, group size and "
                "quantization settings"
            )


def _read_own_file(root: pathlib.Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    entries = [entry for entry in manifest["files"] if entry.get("rank") == rank]
    if len(entries) != 1:
        raise CheckpointError(f"checkpoint {root}: the manifest lists no file for rank {rank}")
    entry = entries[0]
    path = root / entry["name"]
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint {root}: {entry['name']}: {error.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint {root}: {entry['name']} is damaged: {len(data)} bytes with sha256 "
            f"{digest[:16]}..., the manifest says {entry['bytes']} bytes with sha256 "
            f"{entry['sha256'][:16]}..."
        )
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if payload.get("rank") != rank:
        raise CheckpointError(
            f"checkpoint {root}: {entry['name']} holds rank {payload.get('rank')}'s state"
        )
    return payload


def _prepare(target: Target, root: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Everything that can fail, with nothing changed yet: the manifest and the saved state."""
    manifest = read_manifest(root)
    _check_layout(root, manifest, target.layout)
    payload = _read_own_file(root, manifest, target.group.rank)
    state = {
        key: value for key, value in payload.items() if key not in ("format", "rank", "layout")
    }
    try:
        target.state.check_state_dict(state)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {root}: {error}") from None
    return manifest, state


def load(target: Target, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore `target` from the checkpoint in `directory`, all or nothing; every rank of the
    target's group must call this. Returns the manifest. See [Note: resume from the masters]."""
    group = target.group
    root = pathlib.Path(directory)
    prepared: tuple[dict[str, Any], dict[str, Any]] | None = None
    try:
        prepared = _prepare(target, root)
        problem = None
    except CheckpointError as error:
        problem = str(error)
    except Exception as error:  # a torch.load of garbage raises anything; still refuse
        problem = f"checkpoint {root}: rank file unreadable: {type(error).__name__}: {error}"
    problems = group.all_gather(problem)
    refused = [(rank, text) for rank, text in enumerate(problems) if text is not None]
    if refused:
        reasons = "; ".join(f"rank {rank}: {text}" for rank, text in refused)
        raise CheckpointError(f"checkpoint {root} refused, nothing was loaded: {reasons}")
    assert prepared is not None
    manifest, state = prepared
    target.state.load_state_dict(state)
    return manifest
