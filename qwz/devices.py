"""Which device a process group's collectives run on, and the CUDA device of this rank.

[Note: collectives on the group's device]
Every tensor a collective sees must live on a device the process group has a backend
for: a plain NCCL group has no CPU backend (a CPU tensor fails at the first
all-reduce), a gloo group reduce-scatters only CPU tensors. :func:`group_device` is
that device: ``cuda:LOCAL_RANK`` when the group's backend has a CUDA part (``"nccl"``
or a mixed ``"cpu:gloo,cuda:nccl"``), the CPU otherwise. The rank's CUDA device comes
from ``LOCAL_RANK`` as DeepSpeed takes it (``torch.cuda.set_device(local_rank)``), so
ranks on one node never share ``cuda:0``. Models, batches, masks and every tensor handed
to a collective follow it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

LOCAL_RANK_ENV = "LOCAL_RANK"
DEEPSPEED_ACCELERATOR_ENV = "DS_ACCELERATOR"


def backend_devices(backend: str) -> dict[str, str]:
    """Device type -> backend of a backend string: ``"nccl"`` -> {"cuda": "nccl"},
    ``"gloo"`` -> {"cpu": "gloo", "cuda": "gloo"}, ``"cpu:gloo,cuda:nccl"`` as written."""
    backend = backend.strip().lower()
    if ":" not in backend:
        if backend == "nccl":
            return {"cuda": "nccl"}
        return {"cpu": backend, "cuda": backend}
    pairs = {}
    for part in backend.split(","):
        device_type, _, name = part.partition(":")
        if not name:
            raise ValueError(f"backend: {backend!r} is invalid: {part!r} is not device:backend")
        pairs[device_type.strip()] = name.strip()
    return pairs


def uses_cuda(backend: str) -> bool:
    """True when the backend reduces CUDA tensors with NCCL (alone or in a mixed backend):
    the models then live on the GPU. gloo alone keeps everything on the CPU."""
    return backend_devices(backend).get("cuda") == "nccl"


def local_cuda_device() -> torch.device:
    """``cuda:LOCAL_RANK``, made the current CUDA device (as DeepSpeed does); without
    LOCAL_RANK the current device. Raises RuntimeError naming LOCAL_RANK when this host
    has no such GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    text = os.environ.get(LOCAL_RANK_ENV)
    if text is None:
        if count == 0:
            raise RuntimeError("an NCCL process group, but torch sees no CUDA device here")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        local_rank = int(text)
    except ValueError:
        raise RuntimeError(f"{LOCAL_RANK_ENV}={text!r} is invalid: not an integer") from None
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"{LOCAL_RANK_ENV}={local_rank}: this host has {count} CUDA device"
            f"{'s' if count != 1 else ''} (an NCCL rank needs its own GPU, cuda:{local_rank})"
        )
    if torch.cuda.current_device() != local_rank:
        torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of [Note: collectives on the group's device]: the CPU without an
    initialised process group or with a CPU-only backend."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    if uses_cuda(str(dist.get_backend(group))):
        return local_cuda_device()
    return torch.device("cpu")


def use_cpu_accelerator_for_gloo(backend: str) -> None:
    """Give DeepSpeed its CPU accelerator when the backend has no NCCL part.

    DeepSpeed picks CUDA whenever torch sees a GPU, then moves models to
    ``cuda:LOCAL_RANK`` and hands CUDA tensors to a gloo group, which cannot reduce-scatter
    them (a host with fewer GPUs than ranks falls back to gloo). Call before DeepSpeed is
    first used in the process: it sets ``DS_ACCELERATOR=cpu`` and, if DeepSpeed's
    accelerator was already chosen, replaces it."""
    if uses_cuda(backend):
        return
    os.environ[DEEPSPEED_ACCELERATOR_ENV] = "cpu"
    import sys

    real_accelerator = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(real_accelerator, "ds_accelerator", None)
    if chosen is not None and chosen.device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        real_accelerator.set_accelerator(CPU_Accelerator())
