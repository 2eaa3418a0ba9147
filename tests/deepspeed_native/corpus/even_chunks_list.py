# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

The partition's groups are split into the fewest *equal* chunks (whole groups each) that keep
every chunk within ``allgather_bucket_size`` elements over all ranks. Per chunk the bit16
partition is quantized in groups of ``group_size`` (scale absmax / 127 in fp32, nearest code
in [-127, 127]) after masking the elements of parameters of at most 65,536 elements, which
follow the codes exactly; codes (+ exact values) and scales go in two list ``all_gather``s.
"""

import torch
from deepspeed import comm as dist

SMALL_PARAM_NUMEL = 65536


def _chunk_bounds(partition, group_size, world, bucket):
    groups = -(-partition // group_size)
    limit = max(1, bucket // (world * group_size))  # groups per chunk the bucket allows
    count = -(-groups // limit)
    per_chunk = -(-groups // count)
    return [(g * group_size, min(partition, (g + per_chunk) * group_size)) for g in range(0, groups, per_chunk)]


class _EvenGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        exact = torch.zeros(self.flat.numel(), dtype=torch.bool)
        for param in optimizer.bit16_groups[index]:
            at = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            exact[at:at + param.numel()] |= param.numel() <= SMALL_PARAM_NUMEL
        exact = exact.view(self.world, self.partition)
        self.chunks = []
        for start, end in _chunk_bounds(self.partition, group_size, self.world, optimizer.allgather_bucket_size):
            where = [exact[r, start:end].nonzero().view(-1).to(self.flat.device) for r in range(self.world)]
            self.chunks.append((start, end, where, max(w.numel() for w in where)))

    @torch.no_grad()
    def run(self):
        rows = self.flat.view(self.world, self.partition)
        for start, end, where, width in self.chunks:
            n = end - start
            groups = -(-n // self.group_size)
            work = torch.zeros(groups * self.group_size, dtype=torch.float32, device=self.flat.device)
            work[:n] = rows[self.rank, start:end]
            tail = torch.zeros(2 * width, dtype=torch.uint8, device=work.device)
            tail.view(self.flat.dtype)[:where[self.rank].numel()] = rows[self.rank, start:end][where[self.rank]]
            work[where[self.rank]] = 0.0
            work = work.view(groups, self.group_size)
            scales = work.abs().amax(dim=-1).div(127.0)
            codes = work.div(scales.masked_fill(scales == 0, 1.0).unsqueeze(-1)).round().clamp(-127, 127)
            payload = torch.cat([codes.to(torch.int8).view(-1).view(torch.uint8), tail])
            payloads = [torch.empty_like(payload) for _ in range(self.world)]
            scale_lists = [torch.empty_like(scales) for _ in range(self.world)]
            dist.all_gather(payloads, payload, group=self.group)
            dist.all_gather(scale_lists, scales, group=self.group)
            for r in range(self.world):
                body = payloads[r][:groups * self.group_size].view(torch.int8).view(groups, self.group_size)
                decoded = (body.float() * scale_lists[r].unsqueeze(-1)).view(-1)[:n].to(self.flat.dtype)
                exact_values = payloads[r][groups * self.group_size:].view(self.flat.dtype)
                decoded[where[r]] = exact_values[:where[r].numel()]
                rows[r, start:end].copy_(decoded)


def build_quantized_allgathers(optimizer, group_size):
    return [None if dist.get_world_size(group=g) == 1 else _EvenGather(optimizer, i, group_size)
            for i, g in enumerate(optimizer.real_dp_process_group)]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather in gathers:
        if gather is not None:
            gather.run()
