"""What every observer shares: checks in bounded pieces, and an all-reduce that is a no-op
on one rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

FLOAT32_EPS = torch.finfo(torch.float32).eps


FLOAT32_TINY = torch.finfo(torch.float32).tiny


def all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


CPU_PIECE_NUMEL = 1 << 16
"""Elements per piece of a check on CPU: its temporaries stay in cache."""


DEVICE_PIECE_NUMEL = 1 << 22
"""Elements per piece of a check on an accelerator: a few 16 MiB temporaries at a time,
never whole-shard copies, in pieces large enough that kernel launches do not dominate."""


def piece_numel(device: torch.device, group_size: int = 1) -> int:
    """Elements per piece of a check of tensors on `device`, a whole number of groups of
    `group_size` (at least one group)."""
    numel = CPU_PIECE_NUMEL if device.type == "cpu" else DEVICE_PIECE_NUMEL
    return max(1, numel // group_size) * group_size
