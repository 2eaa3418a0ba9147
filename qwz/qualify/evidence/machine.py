"""Where a run ran and how it was started: each rank's machine, and the command line.

[Note: where it ran]
Each rank reports its machine (``rank_machine``): its host name, the CPU's model name and
feature flags, and the memory of the device it computes on (the GPU's total memory, or the
host's for a CPU rank). The record keeps the CPU model and flags of rank 0, every rank's
device memory, the number of distinct hosts and a sha256 of their sorted names (which
machines, without publishing their names). None of this enters the environment's
fingerprint: the ledger compares hashes between runs on machines that compute alike
(device names, versions), whatever they are called.

[Note: reproduce]
The record keeps the ``qwz-qualify`` arguments as given and the environment variables that
change what a run computes or where: ``QWZ_*``, the CPU instruction caps
(``ONEDNN_MAX_CPU_ISA``, ``DNNL_MAX_CPU_ISA``, ``MKL_*``, ``ATEN_CPU_CAPABILITY``), the
device selection and collectives (``CUDA_VISIBLE_DEVICES``, ``NCCL_*``, ``GLOO_*``,
``TORCH_NCCL_*``, ``CUBLAS_WORKSPACE_CONFIG``), thread counts (``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``) and the launch shape (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``). A name
that holds a secret (containing ``KEY``, ``SECRET``, ``TOKEN`` or ``PASSWORD``, such as
the signing key ``QWZ_RECORD_KEY``) is never recorded.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qwz.native import cpu_flags

REPRODUCE_PREFIXES = ("QWZ_", "NCCL_", "GLOO_", "TORCH_NCCL_", "MKL_")
REPRODUCE_NAMES = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)
SECRET_MARKS = ("KEY", "SECRET", "TOKEN", "PASSWORD")


def cpu_model(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (Linux ``model name``; ARM ``Model`` or ``CPU part``)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for wanted in ("model name", "Model", "Hardware"):
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == wanted and value.strip():
                return " ".join(value.split())
    return None


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo (``MemTotal``, ``MemAvailable``) in bytes (Linux); None
    where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host_memory_bytes() -> int | None:
    return meminfo_bytes("MemTotal")


def rank_machine() -> dict[str, Any]:
    """[Note: where it ran] for this rank."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        memory = _host_memory_bytes()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_flags": sorted(cpu_flags()),
        "device_memory_bytes": memory,
    }


def environment_fields(machines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The Environment's fields of [Note: where it ran] from every rank's machine."""
    hosts = sorted({str(machine["hostname"]) for machine in machines})
    first = machines[0] if machines else {}
    return {
        "cpu_model": first.get("cpu_model"),
        "cpu_flags": list(first.get("cpu_flags") or []),
        "device_memory_bytes": [machine.get("device_memory_bytes") for machine in machines],
        "host_count": len(hosts) or None,
        "hosts_sha256": hashlib.sha256("\n".join(hosts).encode()).hexdigest() if hosts else None,
    }


def _recorded(name: str) -> bool:
    if any(mark in name.upper() for mark in SECRET_MARKS):
        return False
    return name in REPRODUCE_NAMES or name.startswith(REPRODUCE_PREFIXES)


def invocation(arguments: Sequence[str], environ: Mapping[str, str] = os.environ) -> dict:
    """[Note: reproduce]: the arguments and the variables that matter, for the record."""
    return {
        "argv": list(arguments),
        "environment": {name: environ[name] for name in sorted(environ) if _recorded(name)},
    }
