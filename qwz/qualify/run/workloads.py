"""Workloads for qualification: a model built from a seed and deterministic batches.

Every workload is defined by data (a name and params) so a record can say
exactly what ran. Batches depend only on (seed, step, rank), never on the
arm, so the reference and candidate arms see the same data, and two runs of
the same head see the same data.

Presets:

* ``qwen3-tiny`` (default): a 2-layer Qwen3 causal LM built by ``transformers``
  from a config (random init, no download), 2.6 M parameters, micro-batches of 2
  sequences of 64 tokens (few tokens per step: the main job stays within 2 minutes on a
  CPU that emulates bf16, and the weight gather is a larger share of the step), on
  learnable synthetic text (a seeded successor map plus 10% random tokens).
  Its embeddings, MLP projections and LM head exceed 65,536 elements, so the
  quantized gather is exercised; attention projections and norms travel exactly.
* ``qwen3-0.6b``: a Qwen3-0.6B-shaped config (28 layers, hidden 1024, vocab
  151,936), sequence 2048, for GPU runners.
* ``qwen3-4b``: the upstream evidence's shape (36 layers, hidden 2560), sequence 2048.
* ``mlp``: a plain MLP without ``transformers`` learning a seeded linear teacher (plus
  noise), for quick runs and tests.
* ``mlp-small``: the same recipe at a quarter of the parameters (two quantized matrices of
  70,400 elements), the CPU workload of the ``long`` preset (qualify/base/presets.py), whose
  thousands of steps are dominated by the per-step observation, not the model.
* ``moe-tiny``: DeepSpeed's MoE layer (4 experts, expert parallelism 2) between two dense
  Linears, learning the same kind of teacher, for the DeepSpeed subjects
  ([Note: MoE workload], run/moe.py).

[Note: attention implementation]
The Qwen3 workloads compute attention with transformers' eager implementation unless the
run's ``attention`` setting says ``sdpa`` (torch's ``scaled_dot_product_attention``, what
transformers uses in training where the backend has it, and what the upstream evidence's
model ran). Eager attention saves the softmax probabilities of every layer for the
backward, ``micro_batch * heads * seq**2`` elements per layer (qualify/request/gpu_memory.py counts
them); SDPA recomputes or fuses them. An ``sdpa`` workload says so in its params
(``"attention": "sdpa"``), so the record, the ledger's key and the hashes it keys tell the
two apart; an eager one has no such key, as in every record before the setting existed.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qwz.qualify.run import moe

QWEN3_PRESETS: Mapping[str, dict[str, Any]] = {
    "qwen3-tiny": {
        "model": dict(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
        "seq_len": 64,
        "micro_batch": 2,
    },
    "qwen3-0.6b": {
        "model": dict(
            vocab_size=151_936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "seq_len": 2048,
        "micro_batch": 1,
    },
    "qwen3-4b": {
        "model": dict(
            vocab_size=151_936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "seq_len": 2048,
        "micro_batch": 1,
    },
}

MLP_PRESETS: Mapping[str, dict[str, Any]] = {
    "mlp": {"sizes": [263, 1031, 257, 3], "micro_batch": 8},
    "mlp-small": {"sizes": [64, 1100, 64, 3], "micro_batch": 8},
}
MLP_PRESET = MLP_PRESETS["mlp"]
MOE_PRESET: dict[str, Any] = {
    "sizes": [263, 257, 3],
    "num_experts": 4,
    "ep_size": 2,
    "micro_batch": 32,
}
"""[Note: MoE workload] (run/moe.py): input, hidden (each expert is hidden x hidden) and
output widths, the experts and the expert-parallel size."""
TEACHER_WORKLOADS = (*MLP_PRESETS, "moe-tiny")
"""Workloads whose batches are (inputs, a seeded linear teacher's targets)."""

WORKLOAD_NAMES = (*QWEN3_PRESETS, *TEACHER_WORKLOADS)


@dataclass(frozen=True)
class Workload:
    """A named model + data recipe; `params` says everything that defines it."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def numel(self, seed: int) -> int:
        """Parameters of the workload's model, counted on the meta device (no memory)."""
        with torch.device("meta"):
            model = self.build_model(seed)
        return sum(parameter.numel() for parameter in model.parameters())

    def build_model(
        self,
        seed: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.nn.Module:
        """The model, initialised from `seed` alone (identical on every rank), created on
        `device` in `dtype` (default: torch's current defaults): a GPU never holds an fp32
        copy of a model that trains in bf16, and the host never holds the model at all.

        The parameters are drawn in `dtype` on `device` (CUDA's generator on a GPU), so
        each (device type, dtype) has its own initial values, the same on every rank and
        in every arm of a run."""
        torch.manual_seed(seed)
        context = torch.device(device) if device is not None else contextlib.nullcontext()
        with context:
            if self.name in MLP_PRESETS:
                return _mlp(self.params["sizes"], dtype)
            if self.name == "moe-tiny":
                model = moe.build(
                    self.params["sizes"], self.params["num_experts"], self.params["ep_size"], seed
                )
                return model if dtype is None else model.to(dtype)
            from transformers import Qwen3Config, Qwen3ForCausalLM

            config = Qwen3Config(**self.params["model"])
            config._attn_implementation = self.params.get("attention", "eager")
            if dtype is None:
                return Qwen3ForCausalLM(config)
            # transformers' own way to create a model in a dtype (its rotary frequencies
            # stay fp32 while they are computed).
            return Qwen3ForCausalLM._from_config(config, dtype=dtype)

    def batch(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        """The CPU tensors of the batch of (seed, step, rank); see `loss`."""
        generator = torch.Generator().manual_seed(_batch_seed(seed, step, rank))
        batch = self.params["micro_batch"]
        if self.name in TEACHER_WORKLOADS:
            sizes = self.params["sizes"]
            inputs = torch.randn(batch, sizes[0], generator=generator)
            teacher = _teacher(sizes[0], sizes[-1], seed)
            noise = torch.randn(batch, sizes[-1], generator=generator)
            return inputs, inputs @ teacher + TEACHER_NOISE * noise
        vocab, seq_len = self.params["model"]["vocab_size"], self.params["seq_len"]
        return (_token_batch(vocab, batch, seq_len, seed, generator),)

    def held_out_batch(self, *, seed: int, index: int, rank: int) -> tuple[torch.Tensor, ...]:
        """Batch `index` of the held-out set: drawn like training batches (same data
        distribution, same successor map or teacher) from a seed space training never uses."""
        return self.batch(seed=seed, step=HELD_OUT_STEP_BASE + index, rank=rank)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The training loss of `model` on `batch` (from :meth:`batch`)."""
        parameter = next(model.parameters())
        if self.name in MLP_PRESETS:
            inputs, targets = batch
            prediction = model(inputs.to(parameter.device, parameter.dtype)).float()
            return torch.nn.functional.mse_loss(prediction, targets.to(parameter.device))
        if self.name == "moe-tiny":
            inputs, targets = batch
            prediction, aux_loss = model(inputs.to(parameter.device, parameter.dtype))
            error = torch.nn.functional.mse_loss(prediction.float(), targets.to(parameter.device))
            return error + moe.AUX_LOSS_WEIGHT * aux_loss.float()
        tokens = batch[0].to(parameter.device)
        return model(input_ids=tokens, labels=tokens).loss.float()

    @property
    def expert_parallel(self) -> bool:
        """Whether the model has experts split over ranks ([Note: MoE workload])."""
        return self.name == "moe-tiny"

    def refusals(self, subject: str, world_size: int) -> list[str]:
        """Why this workload cannot run on `subject` at `world_size`, one line each."""
        if not self.expert_parallel:
            return []
        if subject == "qwz":
            return [
                f"--workload {self.name}: --subject qwz cannot run it: qwz's engine gathers "
                "every parameter over one process group and has no expert parallelism "
                "(DeepSpeed's MoE layer needs DeepSpeed's engine to create its expert groups); "
                "use --subject deepspeed or deepspeed-native"
            ]
        try:
            moe.check_sizes(self.params["num_experts"], self.params["ep_size"], world_size)
        except ValueError as error:
            return [f"--world-size {world_size}: {error}"]
        return []

    def replica_keys(self, model: torch.nn.Module) -> dict[str, str]:
        """Per parameter name, which value this rank holds: ranks with the same key for a
        name must hold the same values ([Note: replica sets], run/replicas.py)."""
        if self.expert_parallel:
            return moe.replica_keys(model)
        return {name: moe.DENSE for name, _ in model.named_parameters()}

    def optimizer_parameters(self, model: torch.nn.Module) -> list[Any]:
        """What ``model_parameters`` a DeepSpeed engine is given: the experts in param
        groups of their own for MoE ([Note: MoE workload]), else the parameters."""
        if self.expert_parallel:
            return moe.optimizer_parameters(model)
        return [p for p in model.parameters() if p.requires_grad]


HELD_OUT_STEP_BASE = 1 << 40
"""Held-out batches use steps from here on; training and timing steps stay far below."""

TEACHER_NOISE = 0.1
"""mlp workload: targets are a fixed, seeded linear teacher of the inputs plus this much
Gaussian noise, so the loss can fall (a workload that cannot learn makes every
qualification INCONCLUSIVE)."""


def _teacher(fan_in: int, fan_out: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 7 + 12_345)
    return torch.randn(fan_in, fan_out, generator=generator) / fan_in**0.5


NOISE = 0.1
"""Fraction of tokens drawn at random instead of from the successor map."""


def _token_batch(
    vocab: int, batch: int, seq_len: int, seed: int, generator: torch.Generator
) -> torch.Tensor:
    """Learnable synthetic text: each token is followed by its successor under a fixed,
    seeded permutation of the vocabulary, except for a fraction NOISE of random tokens. The
    loss can fall from ln(vocab) towards the noise floor, so a trajectory shows learning."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    random_tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    is_noise = torch.rand(batch, seq_len, generator=generator) < NOISE
    tokens = random_tokens.clone()
    for position in range(1, seq_len):
        follow = successor[tokens[:, position - 1]]
        tokens[:, position] = torch.where(is_noise[:, position], random_tokens[:, position], follow)
    return tokens


def _batch_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 4099 + rank


def _mlp(sizes: list[int], dtype: torch.dtype | None = None) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(fan_in, fan_out, dtype=dtype))
        if index < len(sizes) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def get_workload(name: str, attention: str = "eager") -> Workload:
    """The workload `name`; a Qwen3 one computes attention as `attention` says ([Note:
    attention implementation])."""
    if name in MLP_PRESETS:
        return Workload(name, dict(MLP_PRESETS[name]))
    if name == "moe-tiny":
        return Workload("moe-tiny", dict(MOE_PRESET))
    if name in QWEN3_PRESETS:
        params = dict(QWEN3_PRESETS[name])
        if attention != "eager":
            params["attention"] = attention
        return Workload(name, params)
    raise ValueError(f"workload: {name!r} is unknown; choose one of {', '.join(WORKLOAD_NAMES)}")
