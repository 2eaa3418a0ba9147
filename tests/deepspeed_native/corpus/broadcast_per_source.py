# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

"Dequantized one source rank at a time": for each chunk, each source rank in turn (last rank
first) broadcasts its int8 codes and a float32 side tensor holding its per-group scales
(absmax / 127 of its bit16 partition, groups of ``group_size``) followed by the exact fp32
master values of its elements of parameters of at most 65,536 elements, which are masked out
of the quantization. Every rank writes the decoded source into the flat buffer before the next
source is sent. Chunks hold at most ``allgather_bucket_size`` elements over all ranks.
"""

import torch
from deepspeed import comm as dist

SMALL_PARAM_NUMEL = 65536


class _BroadcastGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.ranks = [dist.get_global_rank(self.group, r) for r in range(self.world)]
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        small = torch.zeros(self.flat.numel(), dtype=torch.bool)
        for param in optimizer.bit16_groups[index]:
            offset = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            small[offset:offset + param.numel()] = param.numel() <= SMALL_PARAM_NUMEL
        small = small.view(self.world, self.partition)
        per_rank = max(1, optimizer.allgather_bucket_size // self.world // group_size) * group_size
        self.chunks = []
        for start in range(0, self.partition, per_rank):
            end = min(start + per_rank, self.partition)
            where = [torch.nonzero(small[r, start:end]).view(-1).to(self.flat.device) for r in range(self.world)]
            self.chunks.append((start, end, where))

    @torch.no_grad()
    def run(self, masters):
        rows = self.flat.view(self.world, self.partition)
        for start, end, where in self.chunks:
            numel = end - start
            groups = -(-numel // self.group_size)
            for source in reversed(range(self.world)):
                codes = torch.empty(groups * self.group_size, dtype=torch.int8, device=self.flat.device)
                side = torch.empty(groups + where[source].numel(), dtype=torch.float32, device=self.flat.device)
                if source == self.rank:
                    block = torch.zeros(groups * self.group_size, dtype=torch.float32, device=self.flat.device)
                    block[:numel] = rows[source, start:end].float()
                    block[where[source]] = 0.0
                    block = block.view(groups, self.group_size)
                    absmax = block.abs().max(dim=1).values
                    scales = absmax / 127
                    codes.copy_(torch.round(block / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
                                .clamp(-127, 127).view(-1))
                    side[:groups] = scales
                    side[groups:] = masters[start:end][where[source]]
                dist.broadcast(codes, src=self.ranks[source], group=self.group)
                dist.broadcast(side, src=self.ranks[source], group=self.group)
                decoded = (codes.float().view(groups, self.group_size) * side[:groups, None]).view(-1)[:numel]
                decoded[where[source]] = side[groups:]
                rows[source, start:end].copy_(decoded)


def build_quantized_allgathers(optimizer, group_size):
    return [
        _BroadcastGather(optimizer, index, group_size) if dist.get_world_size(group=group) > 1 else None
        for index, group in enumerate(optimizer.real_dp_process_group)
    ]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather, masters in zip(gathers, fp32_partitions):
        if gather is not None:
            gather.run(masters)
