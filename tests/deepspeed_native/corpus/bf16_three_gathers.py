# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

Written the way ``all_gather_dp_groups`` works: the step has already copied each fp32
partition into its bit16 partition, so this quantizes the *bit16* partition. Per chunk
(``allgather_bucket_size`` elements across all ranks, at least one group per rank) three
collectives run: int8 codes, fp32 scales (absmax / 127 per group of ``group_size``), and the
elements of parameters of at most 65,536 elements in the working dtype, which are masked to
zero before quantization. Every rank decodes every source into the flat buffer.
"""

import torch
from deepspeed import comm as dist

SMALL_PARAM_NUMEL = 65536


class _GroupGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        small = torch.zeros(self.flat.numel(), dtype=torch.bool, device=self.flat.device)
        for param in optimizer.bit16_groups[index]:
            start = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            if param.numel() <= SMALL_PARAM_NUMEL:
                small[start:start + param.numel()] = True
        self.small = small.view(self.world, self.partition)
        per_rank = optimizer.allgather_bucket_size // self.world // group_size * group_size
        chunk = max(group_size, per_rank)
        self.chunks = []  # (start, end, groups, small mask (world, end - start), exact width, counts)
        for start in range(0, self.partition, chunk):
            end = min(start + chunk, self.partition)
            mask = self.small[:, start:end]
            counts = [int(n) for n in mask.sum(dim=1)]
            self.chunks.append((start, end, -(-(end - start) // group_size), mask, max(counts), counts))

    @torch.no_grad()
    def run(self):
        rows = self.flat.view(self.world, self.partition)
        for start, end, groups, small, width, counts in self.chunks:
            values = torch.zeros(groups * self.group_size, dtype=torch.float32, device=self.flat.device)
            values[:end - start] = rows[self.rank, start:end].float()
            values[:end - start].masked_fill_(small[self.rank], 0.0)
            blocks = values.view(groups, self.group_size)
            scales = blocks.abs().amax(dim=1) / 127.0
            divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
            codes = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)

            exact = torch.zeros(width, dtype=self.flat.dtype, device=self.flat.device)
            mine = rows[self.rank, start:end][small[self.rank]]
            exact[:mine.numel()] = mine

            all_codes = torch.empty(self.world * codes.numel(), dtype=torch.int8, device=codes.device)
            all_scales = torch.empty(self.world * groups, dtype=torch.float32, device=codes.device)
            all_exact = torch.empty(self.world * width, dtype=self.flat.dtype, device=codes.device)
            dist.all_gather_into_tensor(all_codes, codes.view(-1), group=self.group)
            dist.all_gather_into_tensor(all_scales, scales, group=self.group)
            if width:
                dist.all_gather_into_tensor(all_exact, exact, group=self.group)
            all_codes = all_codes.view(self.world, groups, self.group_size)
            all_scales = all_scales.view(self.world, groups)
            all_exact = all_exact.view(self.world, width)
            for source in range(self.world):
                decoded = (all_codes[source].float() * all_scales[source][:, None]).view(-1)[:end - start]
                decoded = decoded.to(self.flat.dtype)
                decoded[small[source]] = all_exact[source][:counts[source]]
                rows[source, start:end].copy_(decoded)


def build_quantized_allgathers(optimizer, group_size):
    gathers = []
    for index, process_group in enumerate(optimizer.real_dp_process_group):
        single = dist.get_world_size(group=process_group) == 1
        gathers.append(None if single else _GroupGather(optimizer, index, group_size))
    return gathers


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    del fp32_partitions  # the bit16 partitions already hold this step's weights
    for gather in gathers:
        if gather is not None:
            gather.run()
