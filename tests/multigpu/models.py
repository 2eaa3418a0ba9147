"""The multigpu tests' models, their seeded builders and their synthetic batches.

Tests assert exact parameter hashes, partition sizes and wire bytes of these
models, so their architectures, parameter counts and initialisation order are
part of the tests: change one and the measured numbers in the tests' docstrings
change with it.

* :class:`OddWidthMLP` drives qwz's own engine (tests/multigpu/ranks.py).
* :class:`DeepSpeedLayoutMLP` drives DeepSpeed with the drop-in
  (tests/multigpu/deepspeed_ranks.py).
* :class:`MoEMLP` puts DeepSpeed's MoE layer between two dense Linears, for the
  drop-in with expert parallelism (tests/multigpu/moe_ranks.py); it needs deepspeed.

Both read :func:`batch`: ``MICRO_BATCH`` rows of ``IN_FEATURES`` inputs and
``OUT_FEATURES`` targets, drawn on the CPU (the same values whatever the device) and
placed on the device of the model they feed (:func:`device_of`): on NCCL the models live
on ``cuda:LOCAL_RANK`` ([Note: collectives on the group's device], qwz/devices.py).
"""

from __future__ import annotations

import torch

IN_FEATURES = 263
OUT_FEATURES = 3  # a 3-element bias: smaller than one group and than world size 4
MICRO_BATCH = 4

ODD_HIDDEN = 257  # 263 * 257 = 67,591 > 65,536: quantized; not a multiple of 8, 64 or 4
ODD_WIDE = 96

LAYOUT_HIDDEN = 509  # up.weight: 263 * 509 = 133,867 elements > 65,536: quantized
LAYOUT_NARROW = 131  # down.weight: 509 * 131 = 66,679 > 65,536: quantized

MOE_HIDDEN = 257  # up.weight 263 * 257 = 67,591 and each expert's 257 * 257 = 66,049: quantized


class OddWidthMLP(torch.nn.Module):
    """Linear 263->257 (quantized), Linear 257->96, LayerNorm, Linear 96->3 (exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN_FEATURES, ODD_HIDDEN)
        self.mid = torch.nn.Linear(ODD_HIDDEN, ODD_WIDE)
        self.norm = torch.nn.LayerNorm(ODD_WIDE)
        self.head = torch.nn.Linear(ODD_WIDE, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.up(x))
        return self.head(self.norm(torch.tanh(self.mid(hidden))))


class DeepSpeedLayoutMLP(torch.nn.Module):
    """Two quantized Linears around a LayerNorm, then a small exact head.

    202,600 parameters, 2,054 of them in parameters of at most 65,536 elements (the
    biases, the norm and the head), so both the quantized and the exact stream move.
    DeepSpeed's partitions are 101,300 (2 ranks) and 50,650 (4 ranks) elements: not
    multiples of 64 or 8192, and ``up.weight`` spans several partitions.
    """

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN_FEATURES, LAYOUT_HIDDEN)
        self.norm = torch.nn.LayerNorm(LAYOUT_HIDDEN)
        self.down = torch.nn.Linear(LAYOUT_HIDDEN, LAYOUT_NARROW)
        self.head = torch.nn.Linear(LAYOUT_NARROW, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.nn.functional.gelu(self.up(x)))
        return self.head(torch.tanh(self.down(hidden)))


class MoEMLP(torch.nn.Module):
    """Linear 263->257 (dense, quantized), DeepSpeed's MoE layer, Linear 257->3 (dense, exact).

    The MoE layer has a top-1 gate 257->E (dense, exact) and E experts, each a Linear
    257->257 (its weight quantized, its bias exact), of which E / ep_size live on each
    rank. Its forward returns (output, the gate's auxiliary loss).
    """

    def __init__(self, num_experts: int, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.up = torch.nn.Linear(IN_FEATURES, MOE_HIDDEN)
        self.moe = MoE(
            hidden_size=MOE_HIDDEN,
            expert=torch.nn.Linear(MOE_HIDDEN, MOE_HIDDEN),
            num_experts=num_experts,
            ep_size=ep_size,
            k=1,
        )
        self.head = torch.nn.Linear(MOE_HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, aux_loss, _ = self.moe(torch.nn.functional.gelu(self.up(x)))
        return self.head(hidden), aux_loss

    @property
    def local_experts(self) -> list[torch.nn.Linear]:
        return list(self.moe.deepspeed_moe.experts.deepspeed_experts)


def build_moe_mlp(seed: int, num_experts: int, ep_size: int, ep_rank: int) -> MoEMLP:
    """The dense parameters from `seed` alone; each local expert re-initialised from `seed`
    and its global index ``ep_rank * (num_experts // ep_size) + local index``, so every
    expert differs and the ranks holding the same expert hold the same weights."""
    torch.manual_seed(seed)
    model = MoEMLP(num_experts, ep_size)
    for local, expert in enumerate(model.local_experts):
        torch.manual_seed(seed * 1_000 + 1 + ep_rank * len(model.local_experts) + local)
        expert.reset_parameters()
    return model


def build_odd_width_mlp(seed: int) -> OddWidthMLP:
    torch.manual_seed(seed)
    return OddWidthMLP()


def build_deepspeed_layout_mlp(seed: int) -> DeepSpeedLayoutMLP:
    torch.manual_seed(seed)
    return DeepSpeedLayoutMLP()


def device_of(module: torch.nn.Module) -> torch.device:
    """Where `module`'s parameters live (what its batches must follow)."""
    return next(module.parameters()).device


def batch(
    seed: int,
    step: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic (inputs, targets) for one (seed, step, rank), on `device`."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    inputs = torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator)
    targets = torch.randn(MICRO_BATCH, OUT_FEATURES, generator=generator)
    return inputs.to(device, dtype), targets.to(device)
