"""What a qualification run does, as data: the plan, its arms and the settings they share.

A ``RunPlan`` is built by the CLI from its settings (request/preflight.py refuses what cannot
run), pickled to every rank (run/runner.py) and written into the record (evidence/build.py):
nothing here runs a rank or reads a record. ``RunPlan`` and ``Launch`` declare every setting
of ``qwz-qualify run`` once ([Note: one declaration per setting], qualify/base/values.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import MISSING, dataclass, field
from typing import Any, Protocol

from qwz.qualify.base.values import (
    BOOLEAN,
    FINITE,
    NON_NEGATIVE,
    NON_NEGATIVE_FINITE,
    PATH,
    POSITIVE,
    POSITIVE_FINITE,
    SEED,
    STAGE,
    GroupSize,
    Integer,
    OneOf,
    Optional,
    setting,
)

SUBJECTS = ("qwz", "deepspeed", "deepspeed-native")
"""The implementations a run can qualify (run/subjects.py builds their arms)."""
DEEPSPEED_SUBJECTS = ("deepspeed", "deepspeed-native")


REFERENCE = "reference"
CALIBRATION = "calibration"
"""Role and name prefix of the calibration arm: ``calibration-g<G>`` imitates group size G."""
LEARNING_RULES = ("max-gap", "non-inferiority")
"""How ``learning`` judges a candidate (qualify/evidence/rules/learning.py): the worst gap at any
evaluation ([Note: learning margin]) or the long horizon's statistical rule ([Note:
non-inferiority over the horizon], qualify/evidence/rules/horizon.py)."""
ARM_SETS = ("all", "reference")
"""Which arms a run trains (``arm_set``): every arm, or the reference alone -- the default
path, as ``review`` runs it at a pull request's base ([Note: the base runs the reference
alone], qualify/pr_review/__init__.py)."""
DTYPES = ("bf16", "fp16", "fp32")
ATTENTION = ("eager", "sdpa")
"""How the Qwen3 workloads compute attention (qualify/run/workloads.py)."""
KERNELS = ("fused", "eager")
"""The quantize/dequantize kernels a run asks for: fused (qwz's native C kernels on CPU, else
torch.compile) or eager (plain torch operations); the record names what each arm ran."""
MAX_WORLD_SIZE = 4096
BETAS = (0.9, 0.999)
EPS = 1e-8
PROPOSAL_GROUP_SIZE = 64
"""The PR's default group size (its summary: "default 64"): the candidate arms' default here,
and the size a DeepSpeed subject gets with the group size key left out. The harness's own
statement of it, apart from the engine's ``qwz.quant.DEFAULT_GROUP_SIZE`` (the judge never
takes its numbers from what it judges)."""


@dataclass(frozen=True)
class DeepSpeedConfigFile:
    """The user's DeepSpeed config, as read before the run ([Note: the user's DeepSpeed
    config]); recorded in the plan."""

    path: str
    sha256: str
    """Of the file's bytes as read."""
    content: dict[str, Any]
    """The file's JSON object."""
    from_flags: dict[str, Any] = field(default_factory=dict)
    """Dotted key -> value: settings given on the command line whose keys the file leaves
    out, set in every arm's config."""

    def arm_config(self, harness: dict[str, Any]) -> dict[str, Any]:
        """The file with what the harness sets over it ([Note: the user's DeepSpeed config],
        qualify/request/ds_config.py), from the harness's own config of the arm, `harness`
        (``RunPlan.arm_config`` without a file)."""
        config = copy.deepcopy(self.content)
        for dotted, value in self.from_flags.items():
            *sections, key = dotted.split(".")
            _section(config, sections)[key] = value
        zero = config.setdefault("zero_optimization", {})
        harness_zero = harness["zero_optimization"]
        zero.update({key: harness_zero[key] for key in ARM_ZERO_KEYS if key in harness_zero})
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            config[key] = harness[key]
        config["bf16"] = {**config.get("bf16", {}), **harness["bf16"]}
        fp16_enabled = "fp16" in harness
        if "fp16" in config:
            config["fp16"] = {**config["fp16"], "enabled": fp16_enabled}
        elif fp16_enabled:
            config["fp16"] = dict(harness["fp16"])
        config.setdefault("optimizer", copy.deepcopy(harness["optimizer"]))
        return config


ARM_ZERO_KEYS = ("stage", "zero_quantized_weights", "zero_quantized_weights_group_size")
"""Keys of ``zero_optimization`` the harness sets in every arm over the file."""


def _section(config: dict[str, Any], names: list[str]) -> dict[str, Any]:
    for name in names:
        config = config.setdefault(name, {})
    return config


class NamedWorkload(Protocol):
    """What the plan reads of its workload (qualify/run/workloads.py's ``Workload``)."""

    name: str
    params: dict[str, Any]


CHUNKED_SUFFIX = "-chunked"
"""Name suffix of the chunked candidate arm ([Note: the chunked arm], run/chunked_arm.py)."""


@dataclass(frozen=True)
class ArmSpec:
    name: str
    quantized: bool
    group_size: int | None
    noise_group_size: int | None = None
    """Calibration arm only: the group size whose quantization error the noise imitates."""
    allgather_bucket_size: int | None = None
    """The chunked arm only: its own bucket, sized from the workload ([Note: the chunked
    arm]); None: the run's ``allgather_bucket_size``."""

    @property
    def timed(self) -> bool:
        """Whether the speed blocks time this arm: every candidate but the chunked arm, whose
        bucket is the harness's, not the user's (the speed claim is about the user's)."""
        return self.quantized and self.allgather_bucket_size is None


@dataclass(frozen=True)
class RunPlan:
    """Everything a qualification run trains and judges, as data (picklable, recorded).

    This class is longer than 150 lines because it declares every run setting, one field
    with its type, default and help each ([Note: one declaration per setting]).

    A field declared with ``setting()`` is a run setting: its name is the ``run`` flag, the
    matrix spec's key, a preset's key and the record's plan key ([Note: one declaration per
    setting], qualify/base/values.py). The other fields are the harness's own (sample counts, the
    test seams)."""

    workload: NamedWorkload = setting(
        MISSING,
        OneOf.vocabulary("workload"),
        "model and data (qualify/run/workloads.py)",
        matrix="axis",
    )
    subject: str = setting(
        "qwz",
        OneOf(SUBJECTS),
        "qwz: qwz's engine; deepspeed: stock DeepSpeed reference, DeepSpeed + qwz's gather "
        "candidates; deepspeed-native: DeepSpeed's own code for every arm, the config passed "
        "through untouched",
        matrix="axis",
    )
    stage: int = setting(2, STAGE, "ZeRO stage: 1 or 2", matrix="axis")
    dtype: str = setting(
        "bf16",
        OneOf(DTYPES),
        "working dtype (fp16: dynamic loss scaling, overflow-skipped steps judged)",
        matrix="axis",
    )
    group_sizes: tuple[int, ...] = setting(
        (PROPOSAL_GROUP_SIZE,),
        GroupSize(),
        "candidate group size; repeat for several arms",
        matrix="axis",
        flag="--group-size",
        repeated=True,
    )
    steps: int = setting(20, POSITIVE, "lockstep steps")
    arm_set: str = setting(
        "all",
        OneOf(ARM_SETS),
        "the arms trained: all (the reference, the calibration arm, a candidate per group "
        "size) or reference (the reference alone, timed against itself in the speed blocks: "
        "the default path, as review runs it at a pull request's base)",
    )
    blocks: int = setting(4, NON_NEGATIVE, "order-balanced speed blocks (0: no speed blocks)")
    block_steps: int = setting(5, POSITIVE, "timed steps per arm and block")
    warmup_steps: int = setting(2, NON_NEGATIVE, "untimed steps per arm and block")
    seed: int = setting(0, SEED, "data and init seed", matrix="axis")
    lr: float = setting(1e-3, POSITIVE_FINITE, "AdamW learning rate")
    weight_decay: float = setting(
        0.1,
        NON_NEGATIVE_FINITE,
        "AdamW weight decay (nonzero by default, so that a candidate dropping it is caught)",
    )
    gradient_clipping: float = setting(
        1.0, NON_NEGATIVE_FINITE, "clip the gradients' global norm to this (0: no clipping)"
    )
    allgather_bucket_size: int = setting(
        500_000_000, POSITIVE, "DeepSpeed's allgather_bucket_size, in elements"
    )
    reduce_bucket_size: int = setting(
        500_000_000, POSITIVE, "DeepSpeed's reduce_bucket_size, in elements"
    )
    torch_adam: bool = setting(
        True,
        BOOLEAN,
        "DeepSpeed subjects: the AdamW is torch's (--no-torch-adam: DeepSpeed's FusedAdam, its "
        "op built on first use; qwz's engine runs torch's either way)",
    )
    ds_config: DeepSpeedConfigFile | None = setting(
        None,
        Optional(PATH),
        "a DeepSpeed config JSON file, the base of every arm's config: the harness sets the "
        "quantization keys per arm, the stage, the dtype and the micro-batch over it; the "
        "optimizer, buckets, clipping and loss scaling are the file's; a file that contradicts "
        "an arm or a flag is refused ([Note: the user's DeepSpeed config], "
        "qualify/request/ds_config.py)",
    )
    chunked_allgather_bucket_size: int | None = None
    """[Note: the chunked arm] (run/chunked_arm.py): the bucket of one more candidate arm,
    ``candidate-g<G>-chunked`` at the smallest G, sized from the workload so that its gather
    spans several chunks per rank with edges inside parameters; set where a request is resolved
    (request/run_request.py) where the run's own bucket does not already chunk; None: no such
    arm."""
    samples_per_param: int = 64
    """Drift context: sampled elements per parameter compared with the reference."""
    update_samples: int = 512
    """[Note: exact update check]: sampled master elements per shard and rank."""
    eval_every: int = setting(
        5, POSITIVE, "held-out evaluation every N steps, and at step 0 and the last step"
    )
    held_out_batches: int = setting(2, POSITIVE, "held-out batches per rank and evaluation")
    calibration: bool = setting(
        True,
        BOOLEAN,
        "train the calibration arm ([Note: learning margin]; without it the learning margin "
        "is its floor alone)",
    )
    preset: str = setting(
        "default",
        OneOf.vocabulary("preset"),
        "defaults for the settings left unset (qualify/base/presets.py)",
        matrix="axis",
    )
    learning_rule: str = setting(
        "max-gap",
        OneOf(LEARNING_RULES),
        "how learning is judged: max-gap (the worst gap at any evaluation) or "
        "non-inferiority (over the horizon; every held-out batch's loss is recorded)",
    )
    one_arm_at_a_time: bool = setting(
        False,
        BOOLEAN,
        "hold one arm in memory even while timing (rebuilt during warm-up at each switch)",
    )
    kernels: str = setting(
        "fused",
        OneOf(KERNELS),
        "quantize/dequantize kernels: fused (native C on CPU, else torch.compile; eager where "
        "they are not usable, and the record says so) or eager",
    )
    attention: str = setting(
        "eager",
        OneOf(ATTENTION),
        "Qwen3 workloads: eager (transformers' eager attention, which saves the attention "
        "probabilities for the backward) or sdpa (torch's scaled_dot_product_attention, as "
        "models train)",
    )
    qwz_gather: bool = setting(
        True,
        BOOLEAN,
        "deepspeed subject: let qwz's gather take over the candidate arms (--no-qwz-gather: "
        "DeepSpeed stays stock in every arm)",
    )
    deepspeed_src: str | None = setting(
        None,
        Optional(PATH),
        "DeepSpeed subjects: import deepspeed from the source checkout at PATH on every rank "
        "(checked; [Note: subject identity], qualify/run/subjects.py); an editable install "
        "needs no flag (none: the installed deepspeed)",
        matrix=None,
    )
    cpu_quantizer: bool = setting(
        True,
        BOOLEAN,
        "DeepSpeed subjects on a runner without CUDA: run DeepSpeed's quantizer op (a CUDA "
        "kernel, QuantizerBuilder) as the harness's CPU implementation of it, disclosed in the "
        "record ([Note: a CUDA-only subject on a CPU runner], qualify/run/quantizer_op.py); "
        "--no-cpu-quantizer: a subject that loads it cannot run here (exit 5, CANNOT-RUN)",
    )
    arm_hook: str | None = None
    """Test seam: ``"module:function"`` called as ``function(arm_spec, arm_engine, plan)``
    after each candidate arm is built, in every rank; it may change the engine or return a
    replacement. The mutation suite uses it to inject broken candidates; it is recorded in
    the record's plan, so a record says when it ran."""
    fp16_initial_scale_power: int = setting(
        20,
        NON_NEGATIVE,
        "fp16: the dynamic loss scale starts at 2**N ([Note: overflow pattern], "
        "qualify/evidence/rules/overflow_pattern.py: above DeepSpeed's default of 16, so that "
        "the first steps of the shipped workloads overflow)",
    )
    fp16_loss_scale_window: int = setting(
        8, POSITIVE, "fp16: clean steps after which the dynamic scale doubles"
    )
    fp16_hysteresis: int = setting(
        2, POSITIVE, "fp16: overflows tolerated before the dynamic scale halves"
    )
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form data for an ``arm_hook`` (benchmarks/injectors.py names its injector here)."""

    @property
    def arms(self) -> list[ArmSpec]:
        arms = [ArmSpec(REFERENCE, False, None)]
        if self.arm_set == "reference":
            return arms
        if self.calibration:
            size = max(self.group_sizes)
            arms.append(ArmSpec(f"{CALIBRATION}-g{size}", False, None, size))
        arms += [ArmSpec(f"candidate-g{size}", True, size) for size in self.group_sizes]
        if self.chunked_allgather_bucket_size is not None:
            size = min(self.group_sizes)
            name = f"candidate-g{size}{CHUNKED_SUFFIX}"
            arms.append(ArmSpec(name, True, size, None, self.chunked_allgather_bucket_size))
        return arms

    @property
    def eval_steps(self) -> list[int]:
        every = max(1, self.eval_every)
        return sorted({0, self.steps, *range(every, self.steps + 1, every)})

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
        config refuses the key is refused before training. With ``--ds-config`` this config
        supplies only what the harness sets over the user's file ([Note: the user's
        DeepSpeed config], qualify/request/ds_config.py)."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "zero_quantized_weights": arm.quantized,
            "allgather_bucket_size": arm.allgather_bucket_size or self.allgather_bucket_size,
            "reduce_bucket_size": self.reduce_bucket_size,
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
            # torch's AdamW by default: the same update rule as qwz's, and no fused-op build.
            optimizer_params["torch_adam"] = self.torch_adam
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.workload.params["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.gradient_clipping,
            "bf16": {"enabled": self.dtype == "bf16"},
            **({"fp16": self.fp16_section()} if self.dtype == "fp16" else {}),
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": optimizer_params},
        }
        if self.ds_config is None:
            return config
        config = self.ds_config.arm_config(config)  # [Note: the user's DeepSpeed config]
        if arm.allgather_bucket_size is not None:  # the chunked arm's own, over the file's
            config["zero_optimization"]["allgather_bucket_size"] = arm.allgather_bucket_size
        return config

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


@dataclass(frozen=True)
class Launch:
    """The settings of ``run`` that are not the plan: how many ranks, how long, where the
    ledger is and whether speed is gated. Declared like the plan's ([Note: one declaration
    per setting])."""

    world_size: int = setting(
        2,
        Integer(1, MAX_WORLD_SIZE, what=f"in [1, {MAX_WORLD_SIZE}]"),
        "local ranks (under torchrun: its world, which a given value must equal)",
        matrix="axis",
    )
    timeout: float = setting(
        3600.0,
        POSITIVE_FINITE,
        "seconds: the whole run (local ranks) or any one collective (torchrun)",
    )
    ledger: str | None = setting(
        None,
        Optional(PATH),
        "hash ledger directory (none: no reproduction check)",
        matrix=None,
    )
    min_speedup: float | None = setting(
        None,
        Optional(FINITE),
        "fail unless the speed-up interval's lower end reaches this (none: not judged)",
        matrix=None,
    )


def plan_dict(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-friendly data for the record."""
    data = dataclasses.asdict(plan)
    data["workload"] = {"name": plan.workload.name, "params": plan.workload.params}
    data["group_sizes"] = list(plan.group_sizes)
    return data
