# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
The ZeRO++ weight quantizer's arithmetic in plain torch, for accelerators without the CUDA op.

Same interface and arithmetic as ``CUDAQuantizer`` (symmetric 8-bit, one fp32 scale per group):
the input is staged in fp16; per group, q = 256 / (2 * absmax) (1 for an all-zero group); codes
are round-half-even(x * q) clamped to [-128, 127]; the stored scale is 1 / q; dequantize
returns fp16(code * scale), cast to the caller's dtype.
"""

import torch


class TorchWeightQuantizer:
    def quantize(self, param, groups=None):
        values = param.to(torch.half).float().view(groups, -1)
        absmax = values.abs().amax(dim=1, keepdim=True)
        q = torch.where(
            absmax == 0, torch.ones_like(absmax), torch.full_like(absmax, 256.0) / (2 * absmax)
        )
        codes = torch.round(values * q).clamp(-128, 127).to(torch.int8)
        return codes.view(param.shape), torch.ones_like(q) / q

    def dequantize(self, quantized_param, scale, dtype=None):
        groups = scale.numel()
        values = quantized_param.float().view(groups, -1) * scale.float().view(groups, 1)
        dequantized = values.to(torch.half).view(quantized_param.shape)
        if dtype is not None and dequantized.dtype != dtype:
            dequantized = dequantized.to(dtype)
        return dequantized
