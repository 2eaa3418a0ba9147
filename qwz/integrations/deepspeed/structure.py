"""Reading DeepSpeed's ZeRO-1/2 optimizer by what it has, not by one release's attribute names.

[Note: reading DeepSpeed by capability]
The seam (shards.py), the gather's plan (gather.py) and the takeover read, per param group
``i`` of a ``DeepSpeedZeroOptimizer``: the flat working buffer ``bit16_groups_flat[i]``,
its equal per-rank slices ``parallel_partitioned_bit16_groups[i]``, this rank's fp32
master partition ``single_partition_of_fp32_groups[i]``, the dp process group
``real_dp_process_group[i]``, the parameters in flat-buffer order
``round_robin_bit16_groups[i]`` -- every DeepSpeed 0.19 has these -- and where each
parameter starts in the flat buffer. That last one is what releases differ on:

* DeepSpeed 0.19.8 keeps it as ``round_robin_bit16_offsets[i]`` (it may pad between
  parameters, ``round_robin_bit16_padding``), and that list is used when present;
* DeepSpeed 0.19.6 and DeepSpeed's master of 2026-08 have no such list: there the
  parameters are packed back to back, and after ``deepspeed.initialize`` (and after every
  step) each parameter's ``.data`` is a view into ``bit16_groups_flat[i]`` (DeepSpeed's
  ``_update_model_bit16_weights``), so its offset is its storage offset within the flat
  buffer's storage. This reading holds whatever the packing, padding included.

Either way the offsets are checked: ascending, non-overlapping, inside the flat buffer.
When the optimizer has neither, or what it has contradicts itself, :class:`SeamError` names
the attribute the harness needed and the DeepSpeed version and commit it was reading: a
failure to observe the subject, never the subject's failure ([Note: harness errors],
qwz/qualify/evidence/harness_error.py).

[Note: a checkout's real version]
DeepSpeed's ``git_version_info`` takes its version from ``git_version_info_installed.py``,
which ``setup.py`` writes at install time; a plain git checkout has none, and then DeepSpeed
reads ``version.txt`` *relative to the working directory* -- imported from anywhere but the
checkout's root it says "0.0.0". :func:`real_version` reads ``version.txt`` at the
checkout's root instead, and :func:`package_commit` the checkout's live commit.
"""

from __future__ import annotations

import pathlib
import subprocess
from typing import Any

import torch

NEEDED = (
    "bit16_groups_flat",
    "parallel_partitioned_bit16_groups",
    "single_partition_of_fp32_groups",
    "real_dp_process_group",
    "round_robin_bit16_groups",
)
"""What every reading of a DeepSpeedZeroOptimizer needs ([Note: reading DeepSpeed by
capability])."""

OFFSETS = "round_robin_bit16_offsets"
"""The parameter offsets where DeepSpeed keeps them (0.19.8); read from the views otherwise."""


class SeamError(RuntimeError):
    """The harness's seam cannot read this DeepSpeed's optimizer: what it needed, and which
    DeepSpeed (version, commit, path) lacked it. The harness's failure, not the subject's."""


def real_version(package: pathlib.Path, reported: str) -> str:
    """[Note: a checkout's real version]: DeepSpeed's version for the ``deepspeed`` package
    directory `package`, whose ``deepspeed.__version__`` is `reported`."""
    installed = package / "git_version_info_installed.py"
    version_file = package.parent / "version.txt"
    if not installed.is_file() and version_file.is_file():
        text = version_file.read_text(errors="replace").strip()
        if text:
            return text
    return str(reported).strip()


def package_commit(package: pathlib.Path) -> str | None:
    """The live commit of the git checkout whose top holds `package` (``deepspeed/`` at the
    root of DeepSpeed's repository), with "+dirty" for uncommitted changes; None otherwise."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(package), *args],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or (pathlib.Path(top) / package.name).resolve() != package.resolve():
        return None
    sha = git("rev-parse", "HEAD")
    if sha is None:
        return None
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def deepspeed_identity() -> str:
    """ "DeepSpeed 0.19.6 at <commit> from <path>": the imported DeepSpeed, for messages."""
    try:
        import deepspeed
    except ImportError as error:
        return f"no importable DeepSpeed ({error})"
    package = pathlib.Path(deepspeed.__file__).resolve().parent
    version = real_version(package, getattr(deepspeed, "__version__", "unknown"))
    commit = package_commit(package)
    where = f"at {commit}" if commit else "(not a git checkout)"
    return f"DeepSpeed {version} {where} from {package}"


def require(optimizer: Any, *names: str) -> None:
    """Raise :class:`SeamError` naming the first of `names` that `optimizer` lacks."""
    for name in names:
        if not hasattr(optimizer, name):
            raise SeamError(
                f"the harness's DeepSpeed seam needs {type(optimizer).__name__}.{name}, which "
                f"{deepspeed_identity()} does not have; qwz cannot observe this DeepSpeed's "
                "ZeRO-1/2 optimizer"
            )


def _view_offset(param: torch.Tensor, flat: torch.Tensor, expected: int) -> int | None:
    """Where `param`'s data starts in `flat`, when it is a contiguous view into flat's
    storage; a parameter of no elements sits at `expected` (it occupies nothing)."""
    data = param.data
    if data.numel() == 0:
        return expected
    if not data.is_contiguous() or data.dtype != flat.dtype:
        return None
    if data.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    return int(data.storage_offset() - flat.storage_offset())


def parameter_offsets(optimizer: Any, group: int) -> list[tuple[torch.Tensor, int, int]]:
    """``(parameter, offset, numel)`` of every parameter of param group `group`, in
    flat-buffer order ([Note: reading DeepSpeed by capability]); raises SeamError."""
    require(optimizer, *NEEDED)
    params = list(optimizer.round_robin_bit16_groups[group])
    flat = optimizer.bit16_groups_flat[group]
    listed = getattr(optimizer, OFFSETS, None)
    if listed is not None:
        offsets: list[int | None] = [int(offset) for offset in listed[group]]
        source = f"{OFFSETS}[{group}]"
    else:
        offsets, end = [], 0
        for param in params:
            offset = _view_offset(param, flat, end)
            offsets.append(offset)
            end = end if offset is None else offset + param.numel()
        source = f"the views of round_robin_bit16_groups[{group}] into bit16_groups_flat[{group}]"
    if len(offsets) != len(params) or None in offsets:
        raise SeamError(
            f"the harness's DeepSpeed seam needs each parameter's offset in param group "
            f"{group}'s flat buffer: {deepspeed_identity()} has no {OFFSETS}, and "
            f"{'a parameter is not' if None in offsets else 'not every parameter is'} a view "
            f"into bit16_groups_flat[{group}] ({source})"
        )
    result, end = [], 0
    for param, offset in zip(params, offsets, strict=True):
        numel = param.numel()
        if offset < end or offset + numel > flat.numel():
            raise SeamError(
                f"the harness's DeepSpeed seam read parameter offsets from {source} of "
                f"{deepspeed_identity()}: offset {offset} of a parameter of {numel} elements "
                f"is not in [{end}, {flat.numel() - numel}] (after the previous parameter, "
                "inside the flat buffer), so it cannot tell which parameter an element is"
            )
        result.append((param, int(offset), int(numel)))
        end = offset + numel
    return result
