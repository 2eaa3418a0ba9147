# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

Each rank quantizes its fp32 master partition in groups of ``group_size`` (scale computed as
``absmax * (1 / 127)``, codes rounded to nearest in [-127, 127]); the elements of parameters
of at most 65,536 elements are zeroed first and travel exactly. Per chunk, one uint8 message
per rank holds [fp32 scales | int8 codes | exact values in the working dtype]; the messages
are gathered into a list with ``all_gather`` and every rank decodes each of them in turn.
A chunk spans at most ``allgather_bucket_size`` elements over all ranks, one group at least.
"""

import torch
from deepspeed import comm as dist

SMALL_PARAM_NUMEL = 65536
INV_127 = 1.0 / 127.0


def _small_mask(optimizer, index, flat):
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    for param in optimizer.bit16_groups[index]:
        offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
        if param.numel() <= SMALL_PARAM_NUMEL:
            mask[offset:offset + param.numel()] = True
    return mask


class _Chunk:

    def __init__(self, start, end, group_size, mask, item_bytes):
        self.start, self.end = start, end
        self.groups = -(-(end - start) // group_size)
        self.positions = [torch.nonzero(row).view(-1) for row in mask]
        width = max(p.numel() for p in self.positions) * item_bytes
        self.code_at = 4 * self.groups
        self.exact_at = self.code_at + self.groups * group_size
        self.nbytes = self.exact_at + width


class _PackedGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = dist.get_world_size(group=self.group)
        self.rank = dist.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.group_size = group_size
        mask = _small_mask(optimizer, index, self.flat).view(self.world, self.partition)
        step = max(group_size, optimizer.allgather_bucket_size // (self.world * group_size) * group_size)
        self.chunks = [
            _Chunk(start, min(start + step, self.partition), group_size, mask[:, start:start + step],
                   self.flat.element_size()) for start in range(0, self.partition, step)
        ]

    def _encode(self, chunk, master):
        values = torch.zeros(chunk.groups * self.group_size, dtype=torch.float32, device=self.flat.device)
        values[:chunk.end - chunk.start] = master[chunk.start:chunk.end]
        mine = chunk.positions[self.rank]
        exact = values[mine].to(self.flat.dtype)
        values[mine] = 0.0
        blocks = values.view(chunk.groups, self.group_size)
        scales = blocks.abs().amax(dim=1) * INV_127
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        codes = (blocks / safe.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        message = torch.zeros(chunk.nbytes, dtype=torch.uint8, device=self.flat.device)
        message[:chunk.code_at] = scales.view(torch.uint8)
        message[chunk.code_at:chunk.exact_at] = codes.view(-1).view(torch.uint8)
        message[chunk.exact_at:chunk.exact_at + exact.numel() * exact.element_size()] = exact.view(torch.uint8)
        return message

    def _decode(self, chunk, message, source):
        scales = message[:chunk.code_at].view(torch.float32)
        codes = message[chunk.code_at:chunk.exact_at].view(torch.int8).view(chunk.groups, self.group_size)
        values = (codes.to(torch.float32) * scales.unsqueeze(1)).view(-1)[:chunk.end - chunk.start]
        values = values.to(self.flat.dtype)
        positions = chunk.positions[source]
        exact_bytes = positions.numel() * self.flat.element_size()
        values[positions] = message[chunk.exact_at:chunk.exact_at + exact_bytes].view(self.flat.dtype)
        return values

    @torch.no_grad()
    def run(self, master):
        rows = self.flat.view(self.world, self.partition)
        for chunk in self.chunks:
            message = self._encode(chunk, master)
            received = [torch.empty_like(message) for _ in range(self.world)]
            dist.all_gather(received, message, group=self.group)
            for source, payload in enumerate(received):
                rows[source, chunk.start:chunk.end].copy_(self._decode(chunk, payload, source))


def build_quantized_allgathers(optimizer, group_size):
    return [
        None if dist.get_world_size(group=group) == 1 else _PackedGather(optimizer, index, group_size)
        for index, group in enumerate(optimizer.real_dp_process_group)
    ]


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather, master in zip(gathers, fp32_partitions):
        if gather is not None:
            gather.run(master)
