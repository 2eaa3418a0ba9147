"""``qwz-qualify run --preset``: named sets of defaults for the workload, the horizon, the
evaluation cadence, the speed blocks and the learning rule.

``default`` is the 20-step qualification (the flags' documented defaults); ``long`` is
the long horizon, judged by [Note: non-inferiority over the horizon]
(qualify/evidence/horizon.py). A flag given on the command line always wins over its
preset (``--preset long --steps 200`` is a shortened long run, still judged by the
statistical rule); a preset only fills the flags left unset.

[Note: the long preset's workload]
On CPU the long preset trains ``mlp-small`` (qualify/run/workloads.py) for 2,000 steps:
on a small CPU machine a step of any model costs its observation (the exact update
check, the own-shard decode, the replica digests, a dozen collectives) more than its
arithmetic, so the smallest model that still quantizes two matrices buys the most
steps. Where every rank has a GPU (the launcher would pick NCCL) it trains
``qwen3-0.6b`` for as many steps instead; ``--workload`` chooses explicitly either way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """The values a preset gives the flags left unset (and the two plan fields it alone sets)."""

    name: str
    workload: str
    """On CPU, or wherever ``gpu_workload`` is None."""
    steps: int
    eval_every: int
    """Held-out evaluation every this many steps (and at step 0 and the last step)."""
    blocks: int
    """Order-balanced speed blocks (0: no speed measurement)."""
    held_out_batches: int
    """Held-out batches per rank and evaluation (RunPlan.held_out_batches)."""
    learning_rule: str
    """RunPlan.learning_rule (qualify/plan.py, LEARNING_RULES)."""
    gpu_workload: str | None = None
    """The workload where every rank has a GPU ([Note: the long preset's workload])."""
    description: str = ""


PRESETS = {
    "default": Preset(
        "default",
        workload="qwen3-tiny",
        steps=20,
        eval_every=5,
        blocks=4,
        held_out_batches=2,
        learning_rule="max-gap",
        description="20 steps of qwen3-tiny, held-out loss every 5, worst gap within the "
        "calibrated margin; four speed blocks",
    ),
    "long": Preset(
        "long",
        workload="mlp-small",
        steps=2000,
        eval_every=20,
        blocks=0,
        held_out_batches=8,
        learning_rule="non-inferiority",
        gpu_workload="qwen3-0.6b",
        description="2,000 steps (mlp-small on CPU, qwen3-0.6b where every rank has a GPU), "
        "held-out loss of every batch every 20 steps, a one-sided non-inferiority bound over "
        "the last half of the horizon; no speed blocks",
    ),
}
PRESET_NAMES = tuple(PRESETS)


def _has_gpu_per_rank(world_size: int, torchrun: bool) -> bool:
    """Whether the ranks of this run each get a GPU: under torchrun, where this rank has
    one (the CLI then binds it, cli._run_torchrun); else the launcher's own choice."""
    import torch

    from qwz.qualify.run.launch import pick_backend

    if torchrun:
        return torch.cuda.is_available()
    return pick_backend(world_size) == "nccl"


def apply(args: argparse.Namespace, world_size: int, torchrun: bool = False) -> Preset:
    """Fill the ``run`` flags left unset (None) from ``args.preset``; the preset.

    Idempotent: a flag already set, by the user or by an earlier call, is kept."""
    preset = PRESETS[getattr(args, "preset", None) or "default"]
    args.preset = preset.name
    if args.workload is None:
        gpu = preset.gpu_workload is not None and _has_gpu_per_rank(world_size, torchrun)
        args.workload = preset.gpu_workload if gpu else preset.workload
    for name in ("steps", "eval_every", "blocks"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    return preset
