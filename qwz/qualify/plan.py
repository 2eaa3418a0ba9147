"""What a qualification run does, as data: the plan, its arms and the settings they share.

A ``RunPlan`` is built by the CLI (preflight.py refuses what cannot run), pickled to every
rank (run/runner.py) and written into the record (evidence/build.py): nothing here runs a
rank or reads a record.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qwz.qualify.run.workloads import Workload

SUBJECTS = ("qwz", "deepspeed", "deepspeed-native")
"""The implementations a run can qualify (run/subjects.py builds their arms)."""
DEEPSPEED_SUBJECTS = ("deepspeed", "deepspeed-native")


@dataclass(frozen=True)
class AdamWSettings:
    """The hyperparameters the run was configured with (the plan's, per arm identical)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


REFERENCE = "reference"
CALIBRATION = "calibration"
"""Role and name prefix of the calibration arm: ``calibration-g<G>`` imitates group size G."""
LEARNING_RULES = ("max-gap", "non-inferiority")
"""How ``learning`` judges a candidate (qualify/evidence/checks.py): the worst gap at any
evaluation ([Note: learning margin]) or the long horizon's statistical rule ([Note:
non-inferiority over the horizon], qualify/evidence/horizon.py)."""
BETAS = (0.9, 0.999)
EPS = 1e-8
PROPOSAL_GROUP_SIZE = 64
"""The PR's default group size (its summary: "default 64"): the candidate arms' default here,
and the size a DeepSpeed subject gets with the group size key left out. The harness's own
statement of it, apart from the engine's ``qwz.quant.DEFAULT_GROUP_SIZE`` (the judge never
takes its numbers from what it judges)."""


@dataclass(frozen=True)
class ArmSpec:
    name: str
    quantized: bool
    group_size: int | None
    noise_group_size: int | None = None
    """Calibration arm only: the group size whose quantization error the noise imitates."""


@dataclass(frozen=True)
class RunPlan:
    """Everything a qualification run does, as data (picklable, recorded)."""

    workload: Workload
    subject: str = "qwz"
    stage: int = 2
    dtype: str = "bf16"
    group_sizes: tuple[int, ...] = (PROPOSAL_GROUP_SIZE,)
    steps: int = 20
    blocks: int = 4
    block_steps: int = 5
    warmup_steps: int = 2
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.1
    """Set explicitly (and nonzero) so that a candidate dropping it is caught."""
    gradient_clipping: float = 1.0
    allgather_bucket_size: int = 500_000_000
    samples_per_param: int = 64
    """Drift context: sampled elements per parameter compared with the reference."""
    update_samples: int = 512
    """[Note: exact update check]: sampled master elements per shard and rank."""
    eval_every: int = 5
    """Held-out evaluation every this many steps (and at step 0 and the last step)."""
    held_out_batches: int = 2
    """Held-out batches per rank and evaluation."""
    calibrate: bool = True
    """Train the calibration arm ([Note: learning margin])."""
    preset: str = "default"
    """The ``--preset`` the run was planned from (qualify/presets.py); recorded."""
    learning_rule: str = "max-gap"
    """One of LEARNING_RULES; "non-inferiority" also records every held-out batch's loss."""
    one_arm_resident: bool = False
    compile_kernels: bool = False
    integration_enabled: bool = True
    deepspeed_src: str | None = None
    """``--deepspeed-src``: the DeepSpeed checkout every rank imports ([Note: subject
    identity], qualify/run/subjects.py); None: the installed deepspeed."""
    arm_hook: str | None = None
    """Test seam: ``"module:function"`` called as ``function(arm_spec, arm_engine, plan)``
    after each candidate arm is built, in every rank; it may change the engine or return a
    replacement. The mutation suite uses it to inject broken candidates; it is recorded in
    the record's plan, so a record says when it ran."""
    fp16_initial_scale_power: int = 20
    """fp16: dynamic loss scaling starts at 2**this ([Note: overflow pattern],
    qualify/evidence/loss_scaling.py): above DeepSpeed's default of 16, so that the first
    steps of the shipped workloads overflow and the window holds overflow-skipped steps."""
    fp16_loss_scale_window: int = 8
    """fp16: clean steps after which the dynamic scale doubles (so it grows within a run)."""
    fp16_hysteresis: int = 2
    """fp16: overflows tolerated before the dynamic scale halves (DeepSpeed's default)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def arms(self) -> list[ArmSpec]:
        arms = [ArmSpec(REFERENCE, False, None)]
        if self.calibrate:
            size = max(self.group_sizes)
            arms.append(ArmSpec(f"{CALIBRATION}-g{size}", False, None, size))
        return arms + [ArmSpec(f"candidate-g{size}", True, size) for size in self.group_sizes]

    @property
    def eval_steps(self) -> list[int]:
        every = max(1, self.eval_every)
        return sorted({0, self.steps, *range(every, self.steps + 1, every)})

    @property
    def adamw(self) -> AdamWSettings:
        return AdamWSettings(self.lr, BETAS, EPS, self.weight_decay)

    @property
    def shard_alignment(self) -> int | None:
        """The shard alignment every arm's engine is built with: the least common multiple
        of the run's group sizes, so the reference, the calibration arm and every candidate
        share one layout and reduce gradients in one order ([Note: padding rule],
        qwz/layout.py). None for the deepspeed subject, whose arms keep DeepSpeed's own
        partitioning, the same in every arm (qwz's gather reads it, never changes it)."""
        if self.subject != "qwz":
            return None
        return math.lcm(*self.group_sizes)

    def arm_config(self, arm: ArmSpec) -> dict[str, Any]:
        """The DeepSpeed-style config of one arm.

        A candidate carries the request as a user writes it: ``zero_quantized_weights:
        true`` and ``zero_quantized_weights_group_size: G``. For ``deepspeed-native`` the
        group size key is left out at the proposal's default, G = 64 -- what a user who
        wants the default writes, and what DeepSpeed 0.19's strict config accepts (so stock
        0.19 trains and FAILs ``in-effect``); any other G is written, and a DeepSpeed whose
        config refuses the key is refused before training."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "zero_quantized_weights": arm.quantized,
            "allgather_bucket_size": self.allgather_bucket_size,
            "reduce_bucket_size": self.allgather_bucket_size,
        }
        native_default = (
            self.subject == "deepspeed-native" and arm.group_size == PROPOSAL_GROUP_SIZE
        )
        if arm.quantized and not native_default:
            zero["zero_quantized_weights_group_size"] = arm.group_size
        optimizer_params: dict[str, Any] = {
            "lr": self.lr,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": self.weight_decay,
        }
        if self.subject in DEEPSPEED_SUBJECTS:
            # torch's AdamW in both subjects: the same update rule, and no fused-op build.
            optimizer_params["torch_adam"] = True
        return {
            "train_micro_batch_size_per_gpu": self.workload.params["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.gradient_clipping,
            "bf16": {"enabled": self.dtype == "bf16"},
            **({"fp16": self.fp16_section()} if self.dtype == "fp16" else {}),
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": optimizer_params},
        }

    def fp16_section(self) -> dict[str, Any]:
        """The ``fp16`` section of every arm's config: DeepSpeed's dynamic loss scaling,
        every key written out (the judge reads them from the record, never from an engine)."""
        return {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": self.fp16_initial_scale_power,
            "loss_scale_window": self.fp16_loss_scale_window,
            "hysteresis": self.fp16_hysteresis,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
        }


def plan_dict(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-friendly data for the record."""
    data = dataclasses.asdict(plan)
    data["workload"] = {"name": plan.workload.name, "params": plan.workload.params}
    data["group_sizes"] = list(plan.group_sizes)
    return data
