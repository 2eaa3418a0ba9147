# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

Per chunk, three asynchronous ``deepspeed.comm.all_gather_into_tensor`` calls, waited on
together, gather int8 codes of the bit16 partition quantized in groups of ``group_size`` (one fp32
scale per group, ``absmax / 127``, round half to even as ``torch.round`` does), the scales,
and the exact values of the elements of parameters of at most 65,536 elements *in fp32*
(taken from the fp32 master), which are masked out of their groups before quantization.
A chunk is at most ``allgather_bucket_size`` elements over all ranks, at least one group.
"""

import torch
from deepspeed import comm as dist

SMALL_PARAM_NUMEL = 65536


class _AsyncGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        small = torch.zeros(self.flat.numel(), dtype=torch.bool)
        for param in optimizer.bit16_groups[index]:
            offset = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            if param.numel() <= SMALL_PARAM_NUMEL:
                small[offset:offset + param.numel()] = True
        small = small.view(self.world, self.partition).to(self.flat.device)
        rank_chunk = max(group_size, (optimizer.allgather_bucket_size // self.world) // group_size * group_size)
        self.chunks = []
        for start in range(0, self.partition, rank_chunk):
            end = min(start + rank_chunk, self.partition)
            mask = small[:, start:end]
            counts = [int(c) for c in mask.sum(dim=1)]
            self.chunks.append((start, end, mask, counts))

    @torch.no_grad()
    def run(self, master):
        rows = self.flat.view(self.world, self.partition)
        device = self.flat.device
        for start, end, mask, counts in self.chunks:
            n = end - start
            groups = -(-n // self.group_size)
            source = torch.zeros(groups * self.group_size, dtype=torch.float32, device=device)
            source[:n] = torch.where(mask[self.rank], 0.0, rows[self.rank, start:end].float())
            source = source.view(groups, self.group_size)
            scales = source.abs().amax(dim=1) / 127
            codes = torch.where(scales[:, None] > 0, source / scales[:, None], 0.0).round().clamp(-127, 127)
            exact = torch.zeros(max(max(counts), 1), dtype=torch.float32, device=device)
            mine = master[start:end][mask[self.rank]]
            exact[:mine.numel()] = mine
            inputs = [codes.to(torch.int8).flatten(), scales, exact]
            outputs = [torch.empty(self.world * t.numel(), dtype=t.dtype, device=device) for t in inputs]
            handles = [dist.all_gather_into_tensor(o, i, group=self.group, async_op=True) for o, i in zip(outputs, inputs)]
            for handle in handles:
                handle.wait()
            all_codes, all_scales, all_exact = (o.view(self.world, -1) for o in outputs)
            for rank in range(self.world):
                values = all_codes[rank].float().view(groups, self.group_size) * all_scales[rank][:, None]
                values = values.flatten()[:n]
                values[mask[rank]] = all_exact[rank][:counts[rank]]
                rows[rank, start:end].copy_(values)


def build_quantized_allgathers(optimizer, group_size):
    return [(_AsyncGather(optimizer, index, group_size) if dist.get_world_size(group=group) > 1 else None)
            for index, group in enumerate(optimizer.real_dp_process_group)]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather, master in zip(gathers, fp32_partitions):
        if gather is not None:
            gather.run(master)
