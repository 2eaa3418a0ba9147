"""The ``moe-tiny`` workload's model: DeepSpeed's MoE layer between two dense Linears.

[Note: MoE workload]
``TinyMoE`` is Linear(263 -> 257), GELU, DeepSpeed's ``deepspeed.moe.layer.MoE`` (a top-1
gate 257 -> E and E experts, each a Linear 257 -> 257, of which E / ep_size live on each
rank), then Linear(257 -> 3). It learns a seeded linear teacher of its inputs, as the
``mlp`` workload does; the MoE layer's auxiliary (load-balancing) loss is added with
weight :data:`AUX_LOSS_WEIGHT`. Each expert's weight (66,049 elements) and the first
Linear's are quantized; the biases, the gate and the head travel exactly.

Expert parallelism is DeepSpeed's: the layer's process groups are created by DeepSpeed's
own function, before the engine (DeepSpeed's expert-then-data layout: with ep_size 2 on 4
ranks, ranks {0, 2} hold experts 0-1 and {1, 3} experts 2-3), and the optimizer's param
groups are split by ``split_params_into_different_moe_groups_for_optimizer``, as DeepSpeed
documents for ZeRO. Random token selection is off (``use_rts=False``): the gate then draws
no random numbers, so every arm routes the same tokens to the same experts. No token is
dropped (``drop_tokens=False``: an expert's capacity is the most tokens any rank of its
expert-parallel group routes to it): with capacity dropping, a quantization-sized change of
the gate's input could change which tokens an expert drops, a jump in the held-out loss
that the learning check would read as a broken candidate.

Which ranks must hold the same value of a parameter is the workload's to say, not the
engine's ([Note: replica sets], run/replicas.py): every dense parameter is the same on
every rank; a local expert's parameters are keyed by the expert's *global* index, read
from the layer (its expert-parallel rank times the local experts, plus the local index),
so the ranks holding the same expert form one replica set. Each expert is initialised
from the seed and its global index, so different experts start different and a check
comparing the wrong ranks cannot pass by accident.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DENSE = "dense"
"""The replica key of a parameter every rank holds alike ([Note: replica sets],
run/replicas.py); defined here, the leaf, so workloads -> moe imports nothing back."""

AUX_LOSS_WEIGHT = 0.01
"""Weight of the MoE layer's load-balancing loss in the training loss."""


class TinyMoE(torch.nn.Module):
    """See [Note: MoE workload]; ``forward`` returns (prediction, auxiliary loss)."""

    def __init__(self, sizes: list[int], num_experts: int, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        fan_in, hidden, fan_out = sizes
        self.up = torch.nn.Linear(fan_in, hidden)
        self.moe = MoE(
            hidden_size=hidden,
            expert=torch.nn.Linear(hidden, hidden),
            num_experts=num_experts,
            ep_size=ep_size,
            k=1,
            use_rts=False,
            drop_tokens=False,
        )
        self.head = torch.nn.Linear(hidden, fan_out)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, aux_loss, _ = self.moe(torch.nn.functional.gelu(self.up(inputs)))
        return self.head(hidden), aux_loss

    @property
    def local_experts(self) -> list[torch.nn.Module]:
        return list(self.moe.deepspeed_moe.experts.deepspeed_experts)

    def expert_parallel_rank(self) -> int:
        """This rank's index in its expert-parallel group: the layer's group once the engine
        set it, else DeepSpeed's group of that name (0 before the groups exist)."""
        if not dist.is_initialized():
            return 0
        group = getattr(self.moe.deepspeed_moe, "ep_group", None)
        if group is None:
            from deepspeed.utils import groups

            group = groups._get_expert_parallel_group_dict().get(self.moe.expert_group_name)
        return 0 if group is None else dist.get_rank(group=group)


def build(sizes: list[int], num_experts: int, ep_size: int, seed: int) -> TinyMoE:
    """The model from `seed`: dense parameters from the seed alone, each local expert from the
    seed and its global index; on a process group the expert groups are created first
    (collective: every rank builds at the same time). `num_experts` must be a multiple of
    `ep_size`, and the world size a multiple of `ep_size`."""
    check_sizes(num_experts, ep_size, dist.get_world_size() if dist.is_initialized() else None)
    torch.manual_seed(seed)
    model = TinyMoE(sizes, num_experts, ep_size)
    if dist.is_initialized() and not next(model.parameters()).is_meta:
        _create_expert_groups(model.moe.expert_group_name, ep_size)
    for local, expert in enumerate(model.local_experts):
        torch.manual_seed(seed * 1_000 + 1 + global_expert(model, local))
        expert.reset_parameters()
    return model


def _create_expert_groups(name: str, ep_size: int) -> None:
    """DeepSpeed's expert-parallel and expert-data-parallel groups for `ep_size`, created
    with DeepSpeed's own function (what the layer's ``set_deepspeed_parallelism`` calls)
    before the engine exists, so the experts can be initialised by their global index; the
    engine then finds them by name and creates none (collective, once per process)."""
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend=str(dist.get_backend()))
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)


def check_sizes(num_experts: int, ep_size: int, world_size: int | None) -> None:
    """Raise ValueError naming the rule a MoE layout breaks."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(
            f"moe-tiny: num_experts {num_experts} must be a positive multiple of ep_size {ep_size}"
        )
    if world_size is not None and world_size % ep_size:
        raise ValueError(
            f"moe-tiny: world size {world_size} is not a multiple of ep_size {ep_size} (DeepSpeed "
            "places each expert-parallel group of ep_size ranks whole); use a world size of "
            f"{ep_size}, {2 * ep_size}, ..."
        )


def global_expert(model: TinyMoE, local: int) -> int:
    return model.expert_parallel_rank() * len(model.local_experts) + local


def replica_keys(model: TinyMoE) -> dict[str, str]:
    """Per parameter name, which value it holds: ``dense``, or ``expert<global index>``
    ([Note: MoE workload])."""
    keys = {name: DENSE for name, _ in model.named_parameters()}
    for local, expert in enumerate(model.local_experts):
        prefix = next(
            name for name, module in model.named_modules() if module is expert
        )  # moe.deepspeed_moe.experts.deepspeed_experts.<local>
        for name, _ in expert.named_parameters():
            keys[f"{prefix}.{name}"] = f"expert{global_expert(model, local)}"
    return keys


def optimizer_parameters(model: TinyMoE) -> list[dict]:
    """DeepSpeed's param groups for ZeRO with MoE: the dense parameters, and the experts in
    groups of their own (``moe: True``), split by DeepSpeed's own function."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": DENSE}
    )
