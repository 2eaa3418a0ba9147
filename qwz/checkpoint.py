"""Checkpoints of qwz's engine: one file per rank plus a manifest, written atomically.

[Note: checkpoint layout]
A checkpoint is a directory::

    rank00000.pt ... rankNNNNN.pt   one per rank of the data-parallel group (torch.save)
    manifest.json                   written last, by group rank 0

A rank file holds what only that rank has: its fp32 master shards and the torch
optimizer state of those shards (``ZeroOptimizer.state_dict``), the module state the
optimizer does not own (frozen parameters and buffers: BatchNorm statistics may differ
per rank, as in DeepSpeed), and the engine's counters and loss-scale state.

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

Loading is all or nothing: every rank checks the manifest against its engine, its own
file against the manifest's sha256, and the decoded state against its optimizer's
layout; the ranks then exchange verdicts, and only when every rank can load does any
rank change anything. Otherwise every rank raises the same :class:`CheckpointError`,
naming each rank's reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qwz.hashing import param_hash, tensors_hash
from qwz.jsonio import JsonInputError, read_json_file

if TYPE_CHECKING:
    from qwz.engine import Engine

FORMAT = "qwz-checkpoint/2"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; nothing was loaded. The message names the
    directory and what was wrong (on which rank)."""


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


class _Group:
    """The engine's data-parallel group, with the collectives skipped on one rank."""

    def __init__(self, engine: Engine):
        self.process_group = engine.optimizer.process_group
        self.world_size = engine.optimizer.world_size
        self.rank = engine.optimizer.rank

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.process_group)

    def all_gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.process_group)
        return gathered


def _layout_fields(engine: Engine) -> dict[str, Any]:
    """What a checkpoint's shards depend on; loading requires every field to match."""
    config = engine.config
    return {
        "world_size": engine.world_size,
        "stage": config.stage,
        "dtype": config.dtype,
        "group_size": config.group_size,
        "quantized_weights": config.quantized_weights,
        "preserve_numel": config.zero.quantized_weights.preserve_numel,
    }


def _module_extras(engine: Engine) -> dict[str, torch.Tensor]:
    """The module state the optimizer does not own: frozen parameters and buffers."""
    extras = {
        f"param:{name}": param.detach().clone()
        for name, param in engine.module.named_parameters()
        if not param.requires_grad
    }
    extras.update(
        {
            f"buffer:{name}": buffer.detach().clone()
            for name, buffer in engine.module.named_buffers()
        }
    )
    return extras


def _engine_state(engine: Engine) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "global_grad_norm": engine.global_grad_norm,
        "loss_scale": engine.loss_scaler.state_dict(),
    }


def save(engine: Engine, directory: str | os.PathLike[str]) -> pathlib.Path:
    """Write `engine`'s checkpoint into `directory` (created if needed); every rank of the
    engine's group must call this. Returns the manifest's path. See [Note: checkpoint layout]."""
    group = _Group(engine)
    root = pathlib.Path(directory)
    manifest_path = root / MANIFEST
    if engine.micro_steps % engine.config.gradient_accumulation_steps:
        raise CheckpointError(
            f"checkpoint {root}: save_checkpoint called after micro-batch "
            f"{engine.micro_steps % engine.config.gradient_accumulation_steps} of "
            f"{engine.config.gradient_accumulation_steps} of an accumulation window; the "
            "pending gradients are not part of a checkpoint: save after the window's step()"
        )
    try:
        optimizer_state = engine.optimizer.state_dict()
    except RuntimeError as error:  # gradients of a backward without its step()
        raise CheckpointError(f"checkpoint {root}: {error}") from None
    payload = {
        "format": FORMAT,
        "rank": group.rank,
        "layout": _layout_fields(engine),
        "optimizer": optimizer_state,
        "module_extras": _module_extras(engine),
        "engine": _engine_state(engine),
    }
    root.mkdir(parents=True, exist_ok=True)
    if group.rank == 0:
        manifest_path.unlink(missing_ok=True)
    group.barrier()

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    name = rank_file_name(group.rank)
    _write_atomically(root / name, data)
    masters_hash = tensors_hash(engine.optimizer.master_shards().items())
    files = group.all_gather(
        {
            "rank": group.rank,
            "name": name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "masters_hash": masters_hash,
        }
    )
    if group.rank == 0:
        fields = {
            "format": FORMAT,
            **_layout_fields(engine),
            "quantization_group_size": engine.optimizer.quantization_group_size,
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "param_hash": param_hash(engine.module),
            "files": files,
        }
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


def _check_layout(root: pathlib.Path, manifest: dict[str, Any], engine: Engine) -> None:
    for key, here in _layout_fields(engine).items():
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


def _check_module_extras(root: pathlib.Path, engine: Engine, saved: dict[str, Any]) -> None:
    here = _module_extras(engine)
    if saved.keys() != here.keys():
        missing, extra = sorted(here.keys() - saved.keys()), sorted(saved.keys() - here.keys())
        raise CheckpointError(
            f"checkpoint {root}: frozen parameters and buffers differ: missing {missing}, "
            f"unexpected {extra}"
        )
    for name, tensor in here.items():
        value = saved[name]
        if value.dtype != tensor.dtype or value.shape != tensor.shape:
            raise CheckpointError(
                f"checkpoint {root}: {name} is {value.dtype} {tuple(value.shape)} in the "
                f"checkpoint, {tensor.dtype} {tuple(tensor.shape)} in this model"
            )


def _prepare(
    engine: Engine, root: pathlib.Path, rank: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Everything that can fail, with nothing changed yet."""
    manifest = read_manifest(root)
    _check_layout(root, manifest, engine)
    payload = _read_own_file(root, manifest, rank)
    try:
        engine.optimizer.check_state_dict(payload["optimizer"])
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"checkpoint {root}: optimizer state does not fit: {error}") from None
    _check_module_extras(root, engine, payload["module_extras"])
    try:
        engine.loss_scaler.check_state_dict(payload["engine"].get("loss_scale"))
    except ValueError as error:
        raise CheckpointError(f"checkpoint {root}: {error}") from None
    return manifest, payload


@torch.no_grad()
def load(engine: Engine, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore `engine` from the checkpoint in `directory`, all or nothing; every rank of the
    engine's group must call this. Returns the manifest. See [Note: resume from the masters]."""
    group = _Group(engine)
    root = pathlib.Path(directory)
    prepared: tuple[dict[str, Any], dict[str, Any]] | None = None
    try:
        prepared = _prepare(engine, root, group.rank)
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
    manifest, payload = prepared

    engine.optimizer.load_state_dict(payload["optimizer"])
    named = {f"param:{n}": p for n, p in engine.module.named_parameters() if not p.requires_grad}
    named.update({f"buffer:{n}": b for n, b in engine.module.named_buffers()})
    for name, value in payload["module_extras"].items():
        named[name].copy_(value)
    state = payload["engine"]
    engine.global_steps = state["global_steps"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.global_grad_norm = state["global_grad_norm"]
    engine.loss_scaler.load_state_dict(state["loss_scale"])
    return manifest
