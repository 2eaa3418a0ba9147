"""Where a record comes from: the code under test (git head) and the environment."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
import sys

import torch
import torch.distributed as dist

from qwz.native import cpu_flags as _cpu_flags
from qwz.qualify.record import Determinism, Environment, Head, Subject

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


def _git(directory: pathlib.Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_head(directory: pathlib.Path = PACKAGE_DIR) -> Head:
    """Repository, SHA and dirty flag of the checkout holding `directory`."""
    sha = _git(directory, "rev-parse", "HEAD")
    if sha is None:
        return Head(repository=str(directory), sha="unknown", dirty=False)
    top = _git(directory, "rev-parse", "--show-toplevel") or str(directory)
    remote = _git(directory, "config", "--get", "remote.origin.url")
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return Head(repository=remote or top, sha=sha, dirty=bool(status))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def subject(name: str) -> Subject:
    """The implementation under test: qwz itself, or DeepSpeed (with its git SHA if known)."""
    if name == "qwz":
        import qwz

        return Subject(name="qwz", version=qwz.__version__, sha=git_head().sha)
    import deepspeed

    sha = None
    try:
        from deepspeed import git_version_info

        sha = getattr(git_version_info, "git_hash", None)
    except ImportError:
        pass
    if sha in (None, "", "unknown", "[none]"):
        sha = None
        package = pathlib.Path(deepspeed.__file__).resolve().parent
        top = _git(package, "rev-parse", "--show-toplevel")
        # Only DeepSpeed's own source checkout counts: an installed copy inside another
        # repository (say, a virtualenv in qwz's checkout) would report that repository's SHA.
        if top is not None and (pathlib.Path(top) / "deepspeed").resolve() == package:
            sha = _git(package, "rev-parse", "HEAD")
    return Subject(name="deepspeed", version=deepspeed.__version__, sha=sha)


NUMERIC_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
"""CPU features that change which kernels compute bf16/fp16 matmuls, and so their rounding."""


def device_name() -> str:
    """The GPU's name, or for a CPU what decides its numerics: the architecture, the vector
    capability ATen dispatches to, the CPU features oneDNN's bf16/fp16 kernels depend on,
    and caps such as ``ONEDNN_MAX_CPU_ISA`` (:data:`ISA_CAPS`). CPUs that differ there
    round matmuls differently, so the ledger (keyed by the environment) never compares their
    hashes: a nightly pool of mixed machines would otherwise report false mismatches."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    flags = _cpu_flags()
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    parts += [flag for flag in NUMERIC_CPU_FLAGS if flag in flags]
    for variable in ISA_CAPS:
        if os.environ.get(variable):
            parts.append(f"{variable}={os.environ[variable].strip().upper()}")
    return f"cpu ({', '.join(parts)})"


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
"""Environment variables that cap or pin the instructions oneDNN and MKL compute with
(case-insensitive values, named upper-case)."""


def compute_capability() -> str | None:
    """This rank's GPU's compute capability as ``sm_XY``; None on a CPU rank. Kernels
    (Triton's, cuBLAS's choice of algorithm) differ between capabilities."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
        return f"sm_{major}{minor}"
    return None


NVIDIA_DRIVER_FILE = pathlib.Path("/proc/driver/nvidia/version")


def driver_version(version_file: pathlib.Path = NVIDIA_DRIVER_FILE) -> str | None:
    """The loaded NVIDIA kernel driver's version (Linux), None where none is loaded."""
    try:
        text = version_file.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def gpu_versions() -> dict[str, str | None]:
    """CUDA, cuDNN, NCCL, driver and Triton versions (None for what this build lacks)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # a CUDA build without NCCL
            version = torch.cuda.nccl.version()
            nccl = (
                ".".join(str(part) for part in version)
                if isinstance(version, tuple)
                else str(version)
            )
    return {
        "cuda": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "nccl": nccl,
        "driver": driver_version(),
        "triton": _version("triton") or _version("pytorch-triton"),
    }


def environment(
    device_names: list[str],
    compute_capabilities: list[str | None] | None = None,
    determinism: Determinism | None = None,
) -> Environment:
    """Versions, backend, device names and compute capabilities (one per rank), the
    deterministic settings and the world shape of this run."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    capabilities = [item for item in compute_capabilities or [] if item is not None]
    return Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        deepspeed=_version("deepspeed"),
        transformers=_version("transformers"),
        backend=dist.get_backend() if dist.is_initialized() else "none",
        device_names=device_names,
        world_size=world_size,
        node_count=max(1, world_size // max(1, local)),
        platform=f"{platform.system()} {platform.release()} ({sys.platform})",
        compute_capabilities=capabilities,
        determinism=determinism,
        **gpu_versions(),
    )
