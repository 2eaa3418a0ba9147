"""``qwz-qualify run --preset``: named sets of defaults for the workload, the horizon, the
evaluation cadence, the speed blocks and the learning rule.

``default`` is the 20-step qualification (the flags' documented defaults); ``long`` is
the long horizon, judged by [Note: non-inferiority over the horizon]
(qualify/evidence/rules/horizon.py). A flag given on the command line always wins over its
preset (``--preset long --steps 200`` is a shortened long run, still judged by the
statistical rule); a preset only fills the flags left unset.

[Note: the long preset's workload]
On CPU the long preset trains ``mlp-small`` (qualify/run/workloads.py) for 2,000 steps:
on a small CPU machine a step of any model costs its observation (the exact update
check, the own-shard decode, the replica digests, a dozen collectives) more than its
arithmetic, so the smallest model that still quantizes two matrices buys the most
steps. Where every rank has a GPU (the launcher would pick NCCL) it trains
``qwen3-0.6b`` for as many steps instead; ``--workload`` chooses explicitly either way.

[Note: the PR's evidence]
``pr-evidence`` re-runs what upstream PRs #8511/#8513's evidence ran (DESIGN.md,
Background): the Qwen3-4B shape (``qwen3-4b``: 36 layers, hidden 2560, sequence 2048,
micro-batch 1), bf16, ZeRO-2, every local GPU a data-parallel rank (``every_local_gpu``; a
world size given wins), 20 steps, four order-balanced speed blocks, the candidates the PR's
probe saw (64 and 8192), its 100M-element reduce bucket, DeepSpeed's fused AdamW
(``torch_adam`` false: the DeepSpeed subjects build FusedAdam; qwz's engine runs torch's
AdamW either way) and SDPA attention, as the model trains (the eager attention of the other
presets keeps 27 GiB of probabilities at this shape, [Note: activation estimate] in
qualify/request/gpu_memory.py). The subject is DeepSpeed's own code (``deepspeed-native``;
``--deepspeed-src`` names the PR's checkout). Its GPU memory preflight counts the
activations and holds one arm at a time where two do not fit. The speed blocks run under the
rank's deterministic settings ([Note: deterministic ranks], qualify/run/determinism.py),
which the record's ``environment.determinism`` states: a speed-up measured under them is
this harness's number, which need not equal the PR's 1.037x to its last digit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "default"


@dataclass(frozen=True)
class Preset:
    """The values a preset gives the run settings left unset, by the settings' names
    (qualify/base/plan.py declares them; qualify/request/settings.py checks a preset's values)."""

    name: str
    values: Mapping[str, Any]
    gpu_values: Mapping[str, Any] = field(default_factory=dict)
    """Over ``values`` where every rank has a GPU ([Note: the long preset's workload])."""
    description: str = ""
    every_local_gpu: bool = False
    """``world_size`` left unset: one rank per local GPU where there is one ([Note: the PR's
    evidence]); qualify/request/preflight.py counts them."""

    def values_for(self, gpu_per_rank: bool) -> dict[str, Any]:
        return {**self.values, **(self.gpu_values if gpu_per_rank else {})}


PRESETS = {
    DEFAULT: Preset(
        DEFAULT,
        values={"workload": "qwen3-tiny"},
        description="20 steps of qwen3-tiny, held-out loss every 5, worst gap within the "
        "calibrated margin; four speed blocks (the settings' declared defaults)",
    ),
    "long": Preset(
        "long",
        values={
            "workload": "mlp-small",
            "steps": 2000,
            "eval_every": 20,
            "blocks": 0,
            "held_out_batches": 8,
            "learning_rule": "non-inferiority",
        },
        gpu_values={"workload": "qwen3-0.6b"},
        description="2,000 steps (mlp-small on CPU, qwen3-0.6b where every rank has a GPU), "
        "held-out loss of every batch every 20 steps, a one-sided non-inferiority bound over "
        "the last half of the horizon; no speed blocks",
    ),
    "pr-evidence": Preset(
        "pr-evidence",
        values={
            "workload": "qwen3-4b",
            "subject": "deepspeed-native",
            "stage": 2,
            "dtype": "bf16",
            "group_sizes": (64, 8192),
            "steps": 20,
            "blocks": 4,
            "reduce_bucket_size": 100_000_000,
            "torch_adam": False,
            "attention": "sdpa",
        },
        every_local_gpu=True,
        description="upstream PR #8511/#8513's evidence: qwen3-4b at sequence 2048, bf16, "
        "ZeRO-2, a rank per local GPU, 20 steps, four speed blocks, G 64 and 8192, a 100M reduce "
        "bucket, DeepSpeed's fused AdamW, SDPA attention ([Note: the PR's evidence])",
    ),
}
PRESET_NAMES = tuple(PRESETS)
