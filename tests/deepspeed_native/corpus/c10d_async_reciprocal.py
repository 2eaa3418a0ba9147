# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Quantized weight all-gather for ZeRO stages 1 and 2 (``zero_quantized_weights``).

Each chunk's gather is issued with ``torch.distributed.distributed_c10d``'s
``all_gather_into_tensor(async_op=True)`` (the call DeepSpeed's own ``all_gather_coalesced``
makes) before the previous chunk is decoded: two chunks in flight, the next packed while one
travels, their buffers freed as each is decoded. Each rank quantizes its fp32 master partition per
group of ``group_size``: scale ``absmax / 127``, codes ``round(x * (1 / scale))`` (one
reciprocal per group, DeepSpeed-quantizer style) clamped to [-127, 127]. The elements of
parameters of at most 65,536 elements are masked out and sent exactly in the working dtype.
A chunk spans at most ``allgather_bucket_size`` elements over all ranks (one group at least).
"""

import torch
from torch.distributed import distributed_c10d

SMALL_PARAM_NUMEL = 65536


class _AsyncGather:

    def __init__(self, optimizer, index, group_size):
        self.flat = optimizer.bit16_groups_flat[index]
        self.group = optimizer.real_dp_process_group[index]
        self.world = distributed_c10d.get_world_size(group=self.group)
        self.rank = distributed_c10d.get_rank(group=self.group)
        self.partition = self.flat.numel() // self.world
        self.g = group_size
        keep = torch.zeros(self.flat.numel(), dtype=torch.bool)
        for param in optimizer.bit16_groups[index]:
            begin = (param.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
            if param.numel() <= SMALL_PARAM_NUMEL:
                keep[begin:begin + param.numel()] = True
        keep = keep.view(self.world, self.partition)
        groups_per_chunk = max(1, optimizer.allgather_bucket_size // (self.world * group_size))
        span = groups_per_chunk * group_size
        self.spans = []
        for start in range(0, self.partition, span):
            end = min(self.partition, start + span)
            index_per_rank = [keep[r, start:end].nonzero().flatten().to(self.flat.device) for r in range(self.world)]
            self.spans.append((start, end, index_per_rank))

    def _message(self, master, start, end, exact_index, width):
        numel = end - start
        groups = -(-numel // self.g)
        x = torch.nn.functional.pad(master[start:end].float(), (0, groups * self.g - numel))
        exact = torch.zeros(width, dtype=self.flat.dtype, device=x.device)
        exact[:exact_index.numel()] = x[exact_index].to(self.flat.dtype)
        x[exact_index] = 0
        x = x.view(groups, self.g)
        scale = x.abs().amax(dim=1) / 127
        inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        codes = torch.round(x * inverse[:, None]).clamp(-127, 127).to(torch.int8)
        return torch.cat([codes.view(-1).view(torch.uint8), scale.view(torch.uint8), exact.view(torch.uint8)])

    @torch.no_grad()
    def run(self, master):
        rows = self.flat.view(self.world, self.partition)
        in_flight = None
        for start, end, exact_index in self.spans:
            width = -(-max(i.numel() for i in exact_index) // 2) * 2  # rows stay 4-byte aligned
            message = self._message(master, start, end, exact_index[self.rank], width)
            gathered = torch.empty(self.world * message.numel(), dtype=torch.uint8, device=message.device)
            handle = distributed_c10d.all_gather_into_tensor(gathered, message, group=self.group, async_op=True)
            if in_flight is not None:
                self._decode(rows, *in_flight)
            in_flight = (handle, gathered.view(self.world, -1), start, end, exact_index)
        if in_flight is not None:
            self._decode(rows, *in_flight)

    def _decode(self, rows, handle, gathered, start, end, exact_index):
        handle.wait()
        groups = -(-(end - start) // self.g)
        for source in range(self.world):
            payload = gathered[source]
            codes = payload[:groups * self.g].view(torch.int8).view(groups, self.g)
            scale = payload[groups * self.g:groups * self.g + 4 * groups].view(torch.float32)
            exact = payload[groups * self.g + 4 * groups:].view(self.flat.dtype)
            out = (codes.float() * scale[:, None]).flatten()[:end - start].to(self.flat.dtype)
            out[exact_index[source]] = exact[:exact_index[source].numel()]
            rows[source, start:end] = out


def build_quantized_allgathers(optimizer, group_size):
    gathers = []
    for index, group in enumerate(optimizer.real_dp_process_group):
        gathers.append(_AsyncGather(optimizer, index, group_size) if distributed_c10d.get_world_size(group) > 1 else None)
    return gathers


def quantized_all_gather_dp_groups(gathers, fp32_partitions):
    for gather, master in zip(gathers, fp32_partitions):
        if gather is not None:
            gather.run(master)
