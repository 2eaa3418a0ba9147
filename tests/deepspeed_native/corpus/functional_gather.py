# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

Through PyTorch's functional collectives, as compiled code and DTensor gather: each chunk of
each rank's bit16 partition is packed into one uint8 message -- int8 codes (symmetric, scale
absmax / 127 per group of ``group_size``, round to nearest), the fp32 scales, and the exact
bit16 values of parameters of at most 65,536 elements (masked out of the quantization) -- and
gathered with ``_functional_collectives.all_gather_tensor``, whose result is waited on before
each source rank is decoded into the flat buffer. Chunks hold at most ``allgather_bucket_size``
elements over all ranks, one group per rank at least.
"""

import torch
import torch.distributed as torch_dist
from torch.distributed import _functional_collectives as functional

SMALL_PARAM_NUMEL = 65536


class _FunctionalGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = torch_dist.get_world_size(group=self.group)
        self.rank = torch_dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        small = torch.zeros(self.flat.numel(), dtype=torch.bool)
        for param in optimizer.bit16_groups[index]:
            offset = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            small[offset:offset + param.numel()] = param.numel() <= SMALL_PARAM_NUMEL
        small = small.view(self.world, self.partition)
        per_rank = max(1, optimizer.allgather_bucket_size // (self.world * group_size)) * group_size
        self.chunks = []
        for start in range(0, self.partition, per_rank):
            end = min(start + per_rank, self.partition)
            exact = [small[r, start:end].nonzero().view(-1).to(self.flat.device) for r in range(self.world)]
            self.chunks.append((start, end, exact, max(e.numel() for e in exact)))

    def _message(self, values, exact, width):
        groups = -(-values.numel() // self.group_size)
        block = torch.zeros(groups * self.group_size, dtype=torch.float32, device=values.device)
        block[:values.numel()] = values.float()
        kept = torch.zeros(width, dtype=self.flat.dtype, device=values.device)
        kept[:exact.numel()] = values[exact]
        block[exact] = 0.0
        block = block.view(groups, self.group_size)
        scales = block.abs().amax(dim=1) / 127
        codes = torch.round(block / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None])
        codes = codes.clamp(-127, 127).to(torch.int8).view(-1)
        pad = (-(codes.numel() + 4 * groups + kept.numel() * kept.element_size())) % 4
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8), kept.view(torch.uint8),
                          torch.zeros(pad, dtype=torch.uint8, device=values.device)])

    @torch.no_grad()
    def run(self):
        rows = self.flat.view(self.world, self.partition)
        for start, end, exact, width in self.chunks:
            numel = end - start
            groups = -(-numel // self.group_size)
            message = self._message(rows[self.rank, start:end], exact[self.rank], width)
            gathered = functional.all_gather_tensor(message, 0, self.group)
            gathered = functional.wait_tensor(gathered).view(self.world, -1)
            for source in range(self.world):
                payload = gathered[source]
                codes = payload[:groups * self.group_size].view(torch.int8).view(groups, self.group_size)
                scales = payload[groups * self.group_size:groups * (self.group_size + 4)].view(torch.float32)
                kept = payload[groups * (self.group_size + 4):].view(self.flat.dtype)
                decoded = (codes.float() * scales[:, None]).view(-1)[:numel].to(self.flat.dtype)
                decoded[exact[source]] = kept[:exact[source].numel()]
                rows[source, start:end].copy_(decoded)


def build_quantized_allgathers(optimizer, group_size):
    return [
        _FunctionalGather(optimizer, index, group_size) if torch_dist.get_world_size(group=group) > 1 else None
        for index, group in enumerate(optimizer.real_dp_process_group)
    ]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather in gathers:
        if gather is not None:
            gather.run()
