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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "default"


@dataclass(frozen=True)
class Preset:
    """The values a preset gives the run settings left unset, by the settings' names
    (qualify/plan.py declares them; qualify/settings.py checks a preset's values)."""

    name: str
    values: Mapping[str, Any]
    gpu_values: Mapping[str, Any] = field(default_factory=dict)
    """Over ``values`` where every rank has a GPU ([Note: the long preset's workload])."""
    description: str = ""

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
}
PRESET_NAMES = tuple(PRESETS)
