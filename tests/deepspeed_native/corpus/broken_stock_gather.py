# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""BROKEN on purpose: ``zero_quantized_weights`` is accepted, but every rank's bit16 partition
is all-gathered unquantized (two bytes per element), in chunks of ``allgather_bucket_size``."""

import torch
from deepspeed import comm as dist


class _PlainGather:

    def __init__(self, optimizer, index):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.step = max(1, optimizer.allgather_bucket_size // self.world)

    @torch.no_grad()
    def run(self):
        rows = self.flat.view(self.world, self.partition)
        for start in range(0, self.partition, self.step):
            end = min(start + self.step, self.partition)
            received = torch.empty(self.world * (end - start), dtype=self.flat.dtype, device=self.flat.device)
            dist.all_gather_into_tensor(received, rows[self.rank, start:end].contiguous(), group=self.group)
            rows[:, start:end].copy_(received.view(self.world, -1))


def build_quantized_allgathers(optimizer, group_size):
    del group_size
    return [None if dist.get_world_size(group=g) == 1 else _PlainGather(optimizer, i)
            for i, g in enumerate(optimizer.real_dp_process_group)]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather in gathers:
        if gather is not None:
            gather.run()
