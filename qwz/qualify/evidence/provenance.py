"""Where a record comes from: the code under test (git head) and the environment."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

import torch
import torch.distributed as dist

from qwz.native import cpu_flags as _cpu_flags
from qwz.qualify.evidence import machine
from qwz.qualify.evidence.schema import Determinism, Environment, Head, Subject

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2]


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


def _git_bytes(top: pathlib.Path, *args: str) -> bytes:
    """The standard output of ``git -C top ARGS``; raises when git fails or is missing."""
    return subprocess.run(
        ["git", "-C", str(top), *args], capture_output=True, timeout=60, check=True
    ).stdout


def _diff_digest(top: pathlib.Path) -> str | None:
    """sha256 of the uncommitted changes of the checkout at `top` (``git diff HEAD --binary``,
    then each untracked, not ignored file's path and bytes); None when there are none."""
    try:
        diff = _git_bytes(top, "diff", "HEAD", "--binary", "--no-ext-diff")
        untracked = _git_bytes(top, "ls-files", "--others", "--exclude-standard", "-z")
    except (OSError, subprocess.SubprocessError):
        return None
    names = sorted(name for name in untracked.decode(errors="surrogateescape").split("\0") if name)
    if not diff and not names:
        return None
    digest = hashlib.sha256(diff)
    for name in names:
        digest.update(b"\0untracked\0" + name.encode(errors="surrogateescape") + b"\0")
        with contextlib.suppress(OSError):
            digest.update((top / name).read_bytes())
    return digest.hexdigest()


def git_head(directory: pathlib.Path = PACKAGE_DIR) -> Head:
    """Repository, SHA, dirty flag and diff digest of the checkout holding `directory`
    (default: qwz's own, the harness's)."""
    sha = _git(directory, "rev-parse", "HEAD")
    if sha is None:
        return Head(repository=str(directory), sha="unknown", dirty=False)
    top = pathlib.Path(_git(directory, "rev-parse", "--show-toplevel") or directory)
    remote = _git(directory, "config", "--get", "remote.origin.url")
    diff = _diff_digest(top)
    return Head(
        repository=remote or str(top),
        sha=sha,
        dirty=diff is not None,
        path=str(top),
        diff_sha256=diff,
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _deepspeed_version() -> str | None:
    """The version of the DeepSpeed this process imported (a ``--deepspeed-src`` checkout's
    real one, [Note: a checkout's real version]), else the installed distribution's."""
    imported = sys.modules.get("deepspeed")
    if imported is None or getattr(imported, "__file__", None) is None:
        return _version("deepspeed")
    from qwz.integrations.deepspeed.structure import real_version

    package = pathlib.Path(imported.__file__).resolve().parent
    return real_version(package, getattr(imported, "__version__", "unknown"))


def package_checkout(package: pathlib.Path) -> Head | None:
    """The git checkout `package` (an imported package's directory) was imported from, or
    None. Only the package's own source checkout counts -- the package directory sits at the
    checkout's top, as ``deepspeed/`` in DeepSpeed's repository: an installed copy inside
    another repository (a virtualenv in qwz's checkout) would report that repository."""
    top = _git(package, "rev-parse", "--show-toplevel")
    if top is None or (pathlib.Path(top) / package.name).resolve() != package.resolve():
        return None
    return git_head(package)


def _direct_url(distribution: str, package: pathlib.Path) -> dict | None:
    """The PEP 610 ``direct_url.json`` of the installed `distribution`, when that
    distribution is the one `package` was imported from (an editable install's url names
    the checkout; a wheel's names where it came from)."""
    try:
        found = importlib.metadata.distribution(distribution)
        text = found.read_text("direct_url.json")
        installed_here = pathlib.Path(str(found.locate_file(package.name))).resolve() == package
    except (importlib.metadata.PackageNotFoundError, OSError):
        return None
    if text is None:
        return None
    try:
        loaded = json.loads(text)
    except ValueError:
        return None
    if not isinstance(loaded, dict):
        return None
    url = str(loaded.get("url", ""))
    editable_here = url.removeprefix("file://") == str(package.parent)
    return loaded if installed_here or editable_here else None


def subject(name: str) -> Subject:
    """The implementation under test ([Note: subject identity] in qwz/qualify/run/subjects.py):
    its version, where its package was imported from, and the live commit, dirty flag and
    diff digest of the checkout it lies in -- never a commit written at install time."""
    if name == "qwz":
        import qwz

        head = git_head()
        return Subject(
            name="qwz",
            version=qwz.__version__,
            sha=None if head.sha == "unknown" else head.sha,
            dirty=head.dirty if head.sha != "unknown" else None,
            diff_sha256=head.diff_sha256,
            import_path=str(PACKAGE_DIR),
        )
    import deepspeed

    from qwz.integrations.deepspeed import structure

    package = pathlib.Path(deepspeed.__file__).resolve().parent
    checkout = package_checkout(package)
    installed = None
    with contextlib.suppress(ImportError):
        from deepspeed import git_version_info

        installed = getattr(git_version_info, "git_hash", None)
    return Subject(
        name=name,
        version=structure.real_version(package, deepspeed.__version__),
        sha=checkout.sha if checkout else None,
        dirty=checkout.dirty if checkout else None,
        diff_sha256=checkout.diff_sha256 if checkout else None,
        import_path=str(package),
        installed_commit=installed if installed not in (None, "", "unknown", "[none]") else None,
        direct_url=_direct_url("deepspeed", package),
    )


def subject_head(name: str, identity: Subject) -> Head:
    """The record's head: the checkout of the code under test. For ``deepspeed-native``
    DeepSpeed's (a wheel without a checkout: its origin, SHA 'unknown'); otherwise qwz's,
    whose code (its engine, or its gather inside DeepSpeed) is what the candidates run."""
    if name != "deepspeed-native":
        return git_head()
    package = pathlib.Path(identity.import_path or ".")
    checkout = package_checkout(package)
    if checkout is not None:
        return checkout
    origin = (identity.direct_url or {}).get("url") or f"deepspeed {identity.version} at {package}"
    return Head(repository=str(origin), sha="unknown", dirty=False, path=str(package))


def code_under_test(name: str) -> dict[str, dict]:
    """The record's ``head`` (the subject's checkout), ``harness`` (qwz's) and ``subject``."""
    identity = subject(name)
    return {
        "head": subject_head(name, identity).model_dump(),
        "harness": git_head().model_dump(),
        "subject": identity.model_dump(),
    }


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
    machines: list[dict] | None = None,
    world_size: int | None = None,
) -> Environment:
    """Versions, backend, device names and compute capabilities (one per rank), the
    deterministic settings, the world shape of this run, and every rank's machine
    ([Note: where it ran], qualify/evidence/machine.py; default: this process's, for every rank).
    `world_size`: the ranks' (default: this process group's; the launcher, which writes a
    crash record outside any group, passes the ranks' own, or one-rank rules would judge it)."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    capabilities = [item for item in compute_capabilities or [] if item is not None]
    return Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        deepspeed=_deepspeed_version(),
        transformers=_version("transformers"),
        backend=dist.get_backend() if dist.is_initialized() else "none",
        device_names=device_names,
        world_size=world_size,
        node_count=max(1, world_size // max(1, local)),
        platform=f"{platform.system()} {platform.release()} ({sys.platform})",
        compute_capabilities=capabilities,
        determinism=determinism,
        **gpu_versions(),
        **machine.environment_fields(machines or [machine.rank_machine()] * world_size),
    )
