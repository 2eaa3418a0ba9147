"""The evidence record's schema: pydantic models of what a record stores.

A record is written once by ``qwz-qualify run`` and read by ``report`` and
``compare``. It is bound to the code under test by ``head`` (repository, SHA,
dirty flag) and to itself by ``digest``: the sha256 of its canonical JSON
without the digest (seal.py). A record stores raw observations; its checks and verdict
are derived from them (qualify/evidence/checks.py), at sealing and again on every load
(record.py).

``python -m qwz.qualify.evidence.schema`` regenerates ``record.schema.json`` (the
published JSON Schema) from the models.

This file is longer than 600 lines because the schema is one versioned document: every model
of a record, read together (the JSON Schema is generated from them whole, and an upgrader of
an older record reads them all).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from qwz.qualify.evidence.signing import Signature

SCHEMA_VERSION = 6
"""The one place the record's schema version is written ([Note: schema versions], upgrade.py)."""
OLDEST_SCHEMA_VERSION = 2
"""The oldest schema this qwz reads (upgrade.py upgrades it in memory)."""
SCHEMA_PATH = pathlib.Path(__file__).with_name("record.schema.json")


class RecordError(ValueError):
    """A record could not be trusted: unreadable, invalid, edited, or inconsistent."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Head(_Model):
    """A git checkout: the code under test (``Record.head``: qwz's for the ``qwz`` and
    ``deepspeed`` subjects, DeepSpeed's for ``deepspeed-native``) or the harness that judged
    it (``Record.harness``: always qwz's)."""

    repository: str = Field(description="remote.origin.url, else the checkout's directory")
    sha: str = Field(description="Full git SHA of HEAD, or 'unknown' outside a git checkout")
    dirty: bool = Field(
        description="Uncommitted changes: tracked files edited, or untracked files git does "
        "not ignore"
    )
    path: str | None = Field(None, description="The checkout's top directory where it ran")
    diff_sha256: str | None = Field(
        None,
        description="sha256 of the uncommitted changes (git diff HEAD --binary, then each "
        "untracked file's path and bytes); null when clean",
    )


class Subject(_Model):
    """Which implementation ran the arms, and where its package was imported from."""

    name: Literal["qwz", "deepspeed", "deepspeed-native"]
    version: str
    sha: str | None = Field(
        None,
        description="Live git HEAD of the checkout the package was imported from; null "
        "when it was not imported from one (an installed wheel)",
    )
    dirty: bool | None = Field(None, description="That checkout's uncommitted changes")
    diff_sha256: str | None = Field(None, description="Head.diff_sha256 of that checkout")
    import_path: str | None = Field(None, description="Directory of the imported package")
    installed_commit: str | None = Field(
        None,
        description="The commit the package recorded about itself when it was installed "
        "(DeepSpeed's git_version_info); context only, never its identity",
    )
    direct_url: dict[str, Any] | None = Field(
        None, description="The installed distribution's direct_url.json (PEP 610), if any"
    )
    substituted_ops: list[str] = Field(
        default_factory=list,
        description="Ops of the subject that ran as the harness's own implementation, each in a "
        "sentence ([Note: a CUDA-only subject on a CPU runner], qualify/run/quantizer_op.py): "
        "the verdict covers the subject's plumbing, not those kernels; empty: none (schema 6)",
    )

    def identity(self) -> dict[str, Any]:
        """What identifies the subject's code, for the ledger and ``compare``: the path
        where it ran is left out (the same commit on two machines is the same code)."""
        return self.model_dump(exclude={"import_path"})


class Determinism(_Model):
    """The deterministic settings the ranks ran under (qwz/qualify/run/determinism.py); the
    ``reproduced`` and ``step1-exact`` checks rely on them."""

    deterministic_algorithms: bool = Field(
        description="torch.use_deterministic_algorithms (warn_only: ops without a "
        "deterministic implementation warn instead of failing)"
    )
    warn_only: bool
    fill_uninitialized_memory: bool = Field(
        description="torch.utils.deterministic.fill_uninitialized_memory"
    )
    cublas_workspace_config: str | None = Field(
        description="CUBLAS_WORKSPACE_CONFIG as the ranks saw it"
    )
    cudnn_deterministic: bool
    cudnn_benchmark: bool


class Environment(_Model):
    python: str
    torch: str
    deepspeed: str | None
    transformers: str | None
    backend: str
    device_names: list[str]
    world_size: int
    node_count: int
    platform: str
    cuda: str | None = Field(None, description="CUDA version torch was built with")
    cudnn: str | None = Field(None, description="cuDNN version, where torch has cuDNN")
    nccl: str | None = Field(None, description="NCCL version, where torch has NCCL")
    driver: str | None = Field(None, description="NVIDIA driver version, where one is loaded")
    triton: str | None = Field(None, description="Triton version, where installed")
    compute_capabilities: list[str] = Field(
        default_factory=list, description="Per rank: the GPU's compute capability (sm_XY)"
    )
    determinism: Determinism | None = None
    cpu_model: str | None = Field(
        None,
        description="Rank 0's CPU model name ([Note: where it ran], qualify/evidence/machine.py)",
    )
    cpu_flags: list[str] = Field(default_factory=list, description="Rank 0's CPU feature flags")
    device_memory_bytes: list[int | None] = Field(
        default_factory=list,
        description="Per rank: total memory of its GPU, or of its host for a CPU rank",
    )
    host_count: int | None = Field(None, description="Distinct host names over the ranks")
    hosts_sha256: str | None = Field(
        None, description="sha256 of the ranks' sorted distinct host names, one per line"
    )

    def fingerprint_fields(
        self, against: Environment | None = None, exclude: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """What the fingerprint hashes. Fields a record written before they existed lacks
        (None, empty) are left out -- on both sides when ``against`` is given, so an old
        baseline without ``cuda`` keeps matching a record that has one."""
        payload = self.model_dump(exclude={"platform", *MACHINE_FIELDS, *exclude})
        others = against.model_dump() if against is not None else {}
        for name in LATER_ENVIRONMENT_FIELDS:
            if name in payload and (
                payload[name] in (None, []) or (against is not None and others[name] in (None, []))
            ):
                del payload[name]
        return payload

    def fingerprint(self, against: Environment | None = None, exclude: tuple[str, ...] = ()) -> str:
        """What must match for hashes to be reproducible: versions, backend, devices and
        their compute capabilities, ranks, deterministic settings (:meth:`fingerprint_fields`);
        where it ran (the machine's names, memory) is context, never part of it."""
        payload = self.fingerprint_fields(against, exclude)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


MACHINE_FIELDS = ("cpu_model", "cpu_flags", "device_memory_bytes", "host_count", "hosts_sha256")

LATER_ENVIRONMENT_FIELDS = (
    "cuda",
    "cudnn",
    "nccl",
    "driver",
    "triton",
    "compute_capabilities",
    "determinism",
)


class Invocation(_Model):
    """How the run was started ([Note: reproduce], qualify/evidence/machine.py)."""

    argv: list[str] = Field(description="The qwz-qualify arguments, as given")
    environment: dict[str, str] = Field(
        description="The environment variables that change what or where it ran (no secrets)"
    )


class Workload(_Model):
    name: str
    params: dict[str, Any]
    num_parameters: int
    steps: int
    seed: int


class Arm(_Model):
    """One configuration that was trained: the reference, the calibration arm or a candidate."""

    name: str
    role: Literal["reference", "calibration", "candidate"]
    quantized: bool
    group_size: int | None
    stage: int
    dtype: str
    kernels: Literal["eager", "fused"] = Field(
        description="Quantize/dequantize kernels: eager, or fused (qwz's native C kernels on "
        'CPU, torch.compile otherwise; "compiled" before schema 4)'
    )
    qwz_gather: bool = Field(
        description="deepspeed subject: whether qwz's gather was allowed to take over"
    )
    config: dict[str, Any] = Field(description="The DeepSpeed-style config given to the engine")
    allgather_bucket_size: int | None = Field(
        None,
        ge=1,
        description="The allgather_bucket_size the arm's engine was given (the run's, or the "
        "chunked arm's own: [Note: the chunked arm], qualify/run/chunked_arm.py); null: its "
        "config has none",
    )


class Failure(_Model):
    """How an arm ended early, or that it never started ([Note: failures] in
    qualify/run/runner.py): ``non-finite`` -- every rank saw a NaN/Inf loss or gradient norm
    at the step, the arm ended and the run went on; ``crash`` -- one rank raised, died or
    hung and the run ended there (the rank that failed first, by the launcher's report);
    ``not-run`` -- the run ended before this arm started; ``error`` -- records written
    before crashes ended the run."""

    step: int = Field(description="1-based training step; 0: before the first step")
    rank: int = Field(description="The first rank that reported the failure; -1 for not-run")
    ranks: list[int] = Field(description="Every rank that reported it (crash: that failed)")
    kind: Literal["non-finite", "error", "crash", "not-run"]
    message: str
    parameters: list[str] = Field(
        description="Parameters with a NaN/Inf gradient or weight (the engine's report, else "
        "the working weights that rank holds)"
    )
    last_completed_step: int | None = Field(
        None, description="crash: the failing rank's last completed step of this arm (0: none)"
    )
    phase: str | None = Field(
        None, description="crash: what the failing rank was doing (build, train, timing, ...)"
    )
    signal: str | None = Field(None, description="crash: the signal that killed the rank")
    exit_code: int | None = Field(
        None, description="crash: the rank's exit status, when it died without a report"
    )
    traceback: list[str] = Field(
        default_factory=list, description="crash: the innermost lines of the rank's traceback"
    )
    context: list[str] = Field(
        default_factory=list,
        description="crash: how the other ranks ended (for example their connection reset by "
        "the failed rank): consequences, not the cause",
    )


class HeldOut(_Model):
    step: int
    loss: float | None = Field(description="Mean held-out loss over ranks; null if non-finite")
    batch_losses: list[float | None] = Field(
        default_factory=list,
        description="Under the non-inferiority rule: every held-out batch's loss, rank by rank "
        "(rank r's batch b at r * batches_per_rank + b); empty otherwise",
    )


class Trajectory(_Model):
    arm: str
    steps_planned: int
    losses: list[float | None] = Field(
        description="Loss per completed step, averaged over ranks; null where NaN or infinite"
    )
    grad_norms: list[float | None] = Field(
        description="Global gradient norm per completed step; null where NaN or infinite"
    )
    held_out: list[HeldOut] = Field(
        description="Held-out loss (batches never trained on) at the evaluation steps"
    )
    failure: Failure | None = None


class Violation(_Model):
    """The first element a check found out of bounds."""

    step: int
    rank: int
    parameter: str
    index: int = Field(description="Element index in the flattened parameter; -1: none")
    what: str = ""
    ratio: float | None = Field(description="error / bound; null where infinite")


class Updates(_Model):
    """[Note: exact update check] (qualify/run/observers/update.py), summed over ranks."""

    arm: str
    samples_per_shard: int
    checked: int
    violations: int
    max_ratio: float
    first_violation: Violation | None
    missing_steps: list[list[int]] = Field(
        description="[step, rank] where the optimizer did not step exactly once"
    )
    norm_checked: int = Field(
        0, description="Steps whose global gradient norm and clipping the judge recomputed"
    )
    norm_violations: int = Field(
        0, description="Of those, steps where the gradient handed to the optimizer was wrong"
    )
    norm_max_ratio: float = Field(
        0.0, description="Worst |handed norm - min(norm, clip)| / its bound over the steps"
    )
    skipped_steps: list[list[int]] = Field(
        default_factory=list,
        description="fp16: [step, rank] where the rank's optimizer did not step (legitimate "
        "only where the step overflowed: [Note: overflow pattern])",
    )
    optimizer: str | None = Field(
        None,
        description="The class of the torch optimizer that stepped the masters, on rank 0 "
        "(module.qualname: DeepSpeed's FusedAdam or torch's AdamW ran); null before schema 5",
    )


class StepOneMasters(_Model):
    """Layout-independent digest of every parameter's fp32 master after step 1
    ([Note: layout-independent digests])."""

    arm: str
    digests: dict[str, str] | None = Field(description="null when the arm failed before")
    step: int | None = Field(
        1,
        description="The training step after which they were taken: the arm's first "
        "optimizer step (later than 1 where fp16 overflows skipped the first steps)",
    )


class StepMasters(_Model):
    """After every completed step, a short layout-independent digest of every parameter's fp32
    master ([Note: short digests], qualify/run/observers/digest.py): what the review of a pull
    request compares between its base's and its head's reference arm
    (qualify/evidence/default_path.py)."""

    arm: str
    digests: list[dict[str, str]] = Field(
        description="Per completed step (index 0: after step 1), parameter -> the low 32 bits "
        "of its digest, 8 hex digits"
    )


class LossScaling(_Model):
    """fp16: per training step, what the harness observed of the arm's dynamic loss scaling
    ([Note: overflow observation], qualify/run/observers/overflow.py); judged by [Note: overflow
    pattern] (qualify/evidence/rules/overflow_pattern.py)."""

    arm: str
    scales: list[list[float | None]] = Field(
        description="Per rank, per step: the factor the loss was multiplied by before "
        "backward (the gradient that reached the harness's loss tensor); null: none reached it"
    )
    overflowed: list[bool] = Field(
        description="Per step: some rank's loss-scaled gradient held an Inf or NaN"
    )


class KernelUse(_Model):
    """The wire kernels one rank's arm ran, and every implementation that was dropped."""

    rank: int
    kernels: str | None = Field(
        description='"eager" or "fused" (the native C kernels where they serve, else '
        'torch.compile; "compiled" before schema 4); null: the arm ran none of qwz\'s kernels'
    )
    native: bool = Field(description="Whether the native C kernels served the fused kernels")
    fallbacks: list[str] = Field(
        description="Why a kernel implementation was dropped (it did not reproduce the eager "
        "kernels' bytes, torch.compile failed, a recompile limit): empty when none was"
    )


class SchemeCost(_Model):
    """The decode error of the weights as written, against absmax/127 at the same wire bytes
    and against the working dtype's plain cast, relative to each group's absmax, over the
    quantized elements of every rank's own shard after the last step ([Note: what a scheme
    costs], qualify/run/observers/scheme_cost.py)."""

    elements: int = Field(description="Quantized elements measured (in groups of nonzero absmax)")
    written_worst: float | None = Field(description="max |x_hat - x| / absmax, the written weights")
    written_mean: float | None = Field(description="mean |x_hat - x| / absmax, the written weights")
    absmax127_worst: float | None = Field(description="The same for absmax/127's reference decode")
    absmax127_mean: float | None
    cast_worst: float | None = Field(
        description="The same for the master's plain cast (no quantizing)"
    )
    cast_mean: float | None
    cast_dtype: str = Field(description="The working dtype of that cast")
    fp16_below_normal: int = Field(
        description="Quantized inputs (the master's working cast) nonzero and below fp16's "
        "normal range (2**-14): fp16 staging keeps fewer bits of them, or none"
    )
    fp16_overflow: int = Field(
        description="Quantized inputs that fp16 staging makes infinite (magnitude >= 65,520)"
    )


class OwnShards(_Model):
    """Every rank's own shard against the spec's decode of its fp32 master after every step
    ([Note: the spec's decode], qualify/evidence/spec.py; observers.check_own_shards)."""

    arm: str
    max_ratio: float | None = Field(
        description="Context: worst |working - master| / (scale/2 + 2**-15 scale + the cast's "
        "half-ulp), the spec's scale; null where infinite"
    )
    first_violation: Violation | None
    checked: int = Field(0, description="Elements compared, over ranks and steps")
    mismatches: int = Field(0, description="Elements not equal to the spec's decode (or exact)")
    near_ties: int = Field(
        0, description="Elements at a near-tie that took the other neighbouring code (allowed)"
    )
    reference: int | None = Field(
        None,
        description="Elements equal bit for bit to the reference arithmetic (fp32 master, scale "
        "absmax/127, nearest code; the exact cast where exact); null: a judge that did not "
        "count them ([Note: the contract and its freedoms], qualify/evidence/spec.py)",
    )
    working_input: int = Field(
        0,
        description="Elements not the reference whose group was decoded from the master cast "
        "to the working dtype (a freedom of the contract; 0 before it was allowed)",
    )
    scale_ulp: int = Field(
        0,
        description="Elements not the reference whose group's scale is one fp32 ulp from "
        "absmax/127 (a freedom of the contract; 0 before it was allowed)",
    )
    kernels: list[KernelUse] = Field(default_factory=list, description="Per rank")
    unrounded_decode: int = Field(
        0,
        description="DeepSpeed's ZeRO++ scheme: elements not the reference whose group's decode "
        "was cast once to the working dtype, not rounded through fp16 (a freedom; schema 6)",
    )
    scheme_by_rank: list[str | None] = Field(
        default_factory=list,
        description="Per rank, the contract's scheme its own shard identified ([Note: one scheme "
        "per run], qualify/evidence/contract.py); null: nothing told the schemes apart; empty: "
        "a judge before schemes were named (absmax/127 was the only one)",
    )
    by_scheme: dict[str, int] = Field(
        default_factory=dict,
        description="Elements each scheme alone accounts for, summed over ranks (two schemes "
        "with elements: a run that mixes them)",
    )
    fp16_overflow: int = Field(
        0,
        description="DeepSpeed's ZeRO++ scheme: elements of groups whose input staged an fp16 "
        "infinity (the group decodes to NaN): a weight beyond fp16's range",
    )
    cost: SchemeCost | None = Field(
        None,
        description="What the scheme cost on the run's last weights (null: not measured, or "
        "nothing quantized)",
    )


class Drift(_Model):
    """Context, not a verdict: the sampled parameters' distance from the reference."""

    arm: str
    samples_per_param: int
    max_abs_error: list[float | None] = Field(
        description="Per step, over the sampled elements; null where a sampled weight was not "
        "finite (schema 6: such a run could not be recorded before)"
    )
    bound: list[float] = Field(
        description="Per step, the drift any two AdamW trajectories may have (D_t, "
        "qwz/qualify/evidence/tolerance.py): why this is context and not a check"
    )


class Divergence(_Model):
    step: int
    parameters: list[str]


class ReplicaSet(_Model):
    """The ranks that must hold the same parameters, and their final hashes of them
    ([Note: replica sets], qualify/run/replicas.py)."""

    params: str = Field(description='What they hold: "dense", or "expert<global index>"')
    ranks: list[int]
    hashes: list[str | None] = Field(description="Per rank of `ranks`, its final hash of them")


class Hashes(_Model):
    arm: str
    per_rank: list[str | None] = Field(description="Final parameter hash; null: no final hash")
    replica_sets: list[ReplicaSet] = Field(
        default_factory=list,
        description="Per set of ranks holding the same parameters (every rank for dense "
        "parameters, the ranks holding one expert for its parameters), their final hashes",
    )
    divergence: Divergence | None = Field(
        description="First step after which the ranks' working copies differed"
    )
    ledger_status: Literal["reproduced", "recorded", "mismatch", "not-checked"]
    ledger_previous: str | None = None
    ledger_siblings: dict[str, str] = Field(default_factory=dict)


class WireGroup(_Model):
    """What one rank sent in the weight gather over one process group in the arm's last
    step (the largest collective: over every step), and the spec's counts of the elements it
    holds there (qualify/evidence/wire.py, [Note: group size from the wire])."""

    rank: int
    group_ranks: list[int] = Field(description="Global ranks of the process group")
    bytes_per_step: int = Field(ge=0)
    calls_per_step: int = Field(ge=0, description="Gather collectives over the group")
    quantized_numel: int = Field(
        ge=0, description="Quantized elements: those of parameters above 65,536 elements"
    )
    exact_numel: int = Field(
        ge=0,
        description="Exact elements, which travel exactly: those of parameters of at most "
        "65,536 elements",
    )
    padding_numel: int = Field(ge=0, description="Shard positions no parameter covers")
    element_bytes: int = Field(ge=1, description="Bytes of one working-dtype element")
    params: Literal["dense", "expert", "mixed"] = Field(
        "dense",
        description="Which parameters this rank's shards over the group hold: dense ones, "
        "experts (gathered over their expert-data-parallel group), or both",
    )
    received_bytes_per_step: int | None = Field(
        None,
        ge=0,
        description="Bytes this rank received from its peers in the weight gather over the "
        "group, whatever the collective (qwz/integrations/probe.py); null: recorded by a "
        "harness that counted only the bytes sent, judged by those",
    )
    rows_per_step: int | None = Field(
        None, ge=0, description="Peer rows received: W - 1 per gathered tensor, 1 per broadcast"
    )
    largest_output_bytes: int | None = Field(
        None,
        ge=0,
        description="The largest output of one weight-gather collective over the group in any "
        "step window of the arm (qwz/integrations/probe.py; judged by bounded, [Note: the "
        "staging bound], qualify/evidence/staging.py); null: recorded before it was kept",
    )


class Probe(_Model):
    arm: str
    requested_group_size: int | None
    reported_group_sizes: list[int | None]
    reported_by: list[str | None] = Field(
        default_factory=list,
        description="Per rank, where the subject reported its group size (an engine config "
        "accessor, the optimizer's attribute); null: it reports none",
    )
    wire: list[WireGroup] = Field(
        default_factory=list, description="Every rank's gather bytes per process group"
    )
    gather_bytes_per_step: int = Field(description="Bytes rank 0 sent in the weight gather")
    reference_gather_bytes_per_step: int
    reference_wire: list[WireGroup] = Field(
        default_factory=list,
        description="Every rank's entries of the reference arm's wire; empty: recorded by a "
        "harness that compared rank 0's total sent bytes",
    )
    uncounted_calls: int = Field(
        0,
        ge=0,
        description="Collective calls of this arm or the reference that the probe could not "
        "attribute to a process group (functional collectives, a backend called directly): "
        "probe and in-effect are then inconclusive",
    )
    uncounted: list[str] = Field(default_factory=list, description="Their entry points")


class Block(_Model):
    index: int
    order: Literal["AB", "BA"]
    reference_times_s: list[float] = Field(description="Every timed reference step")
    candidate_times_s: list[float]
    reference_step_s: float = Field(description="Median step time of the reference in the block")
    candidate_step_s: float
    speedup: float = Field(description="reference_step_s / candidate_step_s")
    reference_gather_s: list[float | None] = Field(
        default_factory=list,
        description="Per timed reference step, the seconds of its weight gather ([Note: "
        "gather phase timing], qualify/run/gather_timing.py); null: not measured",
    )
    candidate_gather_s: list[float | None] = Field(default_factory=list)
    reference_gather_step_s: float | None = Field(
        None, description="Median of the reference's measured gather seconds in the block"
    )
    candidate_gather_step_s: float | None = None
    gather_speedup: float | None = Field(
        None, description="reference_gather_step_s / candidate_gather_step_s"
    )


class StagingAllocation(_Model):
    """One allocation live at the window's peak ([Note: staging memory, exactly])."""

    bytes: int = Field(ge=0)
    where: str = Field(description="The subject's line that made it (path:line in function)")

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, value: Any) -> Any:
        return {"bytes": value[0], "where": value[1]} if isinstance(value, list) else value


class Memory(_Model):
    arm: str
    rank: int
    kind: Literal["cuda", "rss"]
    peak_allocated_bytes: int = Field(ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    staging_peak_bytes: int | None = Field(
        None,
        ge=0,
        description="[Note: staging memory, exactly] (qualify/run/observers/staging_memory.py): "
        "the most bytes of tensor storage the subject allocated in one step's gather window "
        "and held at once, over every step; null: not measured (schema 5 and older, or no "
        "torch optimizer marked the masters' update)",
    )
    staging_largest: list[StagingAllocation] = Field(
        default_factory=list, description="The largest allocations live at that peak"
    )


class Performance(_Model):
    arm: str
    block_steps: int
    warmup_steps: int
    blocks: list[Block]
    interval: Literal["bootstrap", "insufficient blocks"]
    median_speedup: float | None
    ci_low: float | None
    ci_high: float | None
    ci_method: str
    p_value: float | None
    test: str
    memory: list[Memory] = Field(description="This candidate arm's peak memory per rank")
    gather_interval: Literal["bootstrap", "insufficient blocks", "not measured"] = Field(
        "not measured",
        description="The weight gather's speed-up (qualify/evidence/gather_speed.py)",
    )
    gather_median_speedup: float | None = None
    gather_ci_low: float | None = None
    gather_ci_high: float | None = None


class Learning(_Model):
    """The raw numbers of [Note: learning margin] (qualify/evidence/rules/learning.py)."""

    eval_steps: list[int]
    held_out_batches_per_rank: int
    calibration_arm: str | None
    calibration_group_size: int | None
    rule: Literal["max-gap", "non-inferiority"] = Field(
        "max-gap",
        description="max-gap: [Note: learning margin] (qualify/evidence/rules/learning.py); "
        "non-inferiority: [Note: non-inferiority over the horizon] "
        "(qualify/evidence/rules/horizon.py)",
    )


class ConformanceRow(_Model):
    """One config of the judge's conformance table as the subject's own parser and engine
    took it ([Note: the PR's config rules], qualify/evidence/rules/conformance.py); the expected
    outcome is the judge's, never stored here."""

    row: str = Field(description="The row's name in the judge's table")
    config: dict[str, Any] = Field(description="The DeepSpeed config the subject was given")
    ran: list[Literal["parse", "initialize"]] = Field(
        description="What the subject was asked: its config parser, then (stages 1 and 2, where "
        "the parser accepted) an engine of a tiny model at world size 1"
    )
    observed: Literal["accepted", "refused"]
    refused_at: Literal["parse", "initialize"] | None = Field(
        description="Where the subject refused it; null: accepted"
    )
    message: str | None = Field(
        description="The subject's own message (the exception's type and text on one line, "
        "bounded); null: accepted"
    )
    group_size: int | None = Field(
        None,
        description="Context: the group size the subject's parser resolved for an accepted "
        "row; null: it resolves none",
    )


class Conformance(_Model):
    """The PR's config rules run through the subject's own parser and engine before any
    training (qualify/run/conformance_run.py)."""

    parser: str = Field(description="What parsed each config")
    engine: str = Field(description="What built an engine from each config it accepted")
    rows: list[ConformanceRow]
    seconds: float = Field(description="Wall time of the whole table")
    error: str | None = Field(
        None,
        description="Why the harness could not run the table (then rows is empty): a harness "
        "error, never the subject's refusal",
    )


CheckStatus = Literal["pass", "fail", "n/a", "inconclusive"]


class Check(_Model):
    name: str
    status: CheckStatus
    detail: str = Field(description="Presentation: never versioned, never compared")
    numbers: dict[str, Any] = Field(default_factory=dict)
    rule: int = Field(
        0,
        ge=0,
        description="The version of its family's rule that judged it ([Note: rule versions], "
        "qualify/evidence/rules/); 0: judged before rules were versioned (schema 2)",
    )

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def evidence(self) -> bool:
        """Whether the check tested something (pass or fail), not n/a or inconclusive."""
        return self.status in ("pass", "fail")


class Verdict(_Model):
    status: Literal["PASS", "FAIL", "INCONCLUSIVE"]
    passed: bool
    failed: list[str]
    inconclusive: list[str]
    evidence: list[str] = Field(description="Checks that tested something (pass or fail)")
    not_applicable: list[str] = Field(description="Checks with nothing to test, and why")


class Judge(_Model):
    """Who judged the record ([Note: judge identity], qualify/evidence/judge.py), sealed
    inside the digest."""

    version: str = Field(description="qwz's version that ran the judge")
    rules: dict[str, int] = Field(description="Check family -> its rule version (RULES)")
    constants_sha256: str = Field(
        description="sha256 of the judge's normative constants (margins, thresholds, the spec's "
        "numbers, the bootstrap's seed and resamples, the horizon's constants)"
    )
    rule_constants_sha256: dict[str, str] = Field(
        default_factory=dict, description="Per rule family, sha256 of the constants it reads"
    )
    libraries: dict[str, str | None] = Field(
        default_factory=dict, description="The statistics libraries' versions (scipy, numpy)"
    )


class DeepSpeedConfigFile(_Model):
    """``--ds-config``: the user's DeepSpeed config file, the base of every arm's config
    ([Note: the user's DeepSpeed config], qualify/request/ds_config.py); each arm's ``config`` is
    what ran."""

    path: str = Field(description="The file, resolved")
    sha256: str = Field(description="sha256 of the file's bytes as read")
    content: dict[str, Any] = Field(description="The file's JSON object")
    from_flags: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted key -> value: settings given on the command line whose keys the "
        "file leaves out, set in every arm's config",
    )


class Plan(BaseModel):
    """The run plan (qwz.qualify.base.plan.RunPlan) as data; the keys a check or a reader relies
    on are typed."""

    model_config = ConfigDict(extra="allow", frozen=True)

    min_speedup: float | None = Field(
        None, description="The lower end the speed-up interval must reach; null: not judged"
    )
    ds_config: DeepSpeedConfigFile | None = Field(
        None,
        description="The user's DeepSpeed config file (schema 5); null: none, every arm's "
        "config is the harness's own",
    )


class Record(_Model):
    schema_version: int = Field(
        SCHEMA_VERSION,
        description="The schema the record is written in (SCHEMA_VERSION; older ones are "
        "upgraded in memory on load, qualify/evidence/upgrade.py)",
    )
    created_at: str
    head: Head
    harness: Head | None = Field(
        None, description="qwz's own checkout, which ran the harness (equal to head for qwz)"
    )
    subject: Subject
    environment: Environment
    invocation: Invocation | None = Field(
        None, description="The command line and environment; null in records before it"
    )
    workload: Workload
    plan: Plan
    arms: list[Arm]
    trajectories: list[Trajectory]
    learning: Learning
    step_one: list[StepOneMasters]
    step_masters: list[StepMasters] = Field(
        default_factory=list,
        description="Every arm's short master digests after every step; empty in records of "
        "schema 4 and older (which did not observe them)",
    )
    updates: list[Updates]
    own_shards: list[OwnShards]
    drift: list[Drift]
    hashes: list[Hashes]
    probes: list[Probe]
    loss_scaling: list[LossScaling] = Field(
        default_factory=list, description="fp16 runs: every arm's loss scaling; empty otherwise"
    )
    memory: list[Memory]
    performance: list[Performance]
    conformance: Conformance | None = Field(
        None,
        description="The PR's config rules run through the subject's parser and engine; null: "
        "not run (records before schema 5)",
    )
    checks: list[Check]
    verdict: Verdict
    judge: Judge | None = Field(
        None, description="The judge's identity; null: a record of schema 2 (judge unknown)"
    )
    digest: str = Field(description="sha256 of the canonical JSON of the record without digest")

    @model_validator(mode="after")
    def _arms_agree(self) -> Record:
        """Every section names arms the record has: each arm once in its own sections, one
        reference (the checks are derived per arm and compare with the reference)."""
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version}: a record in memory is of schema "
                f"{SCHEMA_VERSION} (load upgrades older ones)"
            )
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        if [arm.role for arm in self.arms].count("reference") != 1:
            raise ValueError("a record has exactly one arm with role 'reference'")
        for section in ("trajectories", "step_one", "updates", "hashes"):
            listed = [item.arm for item in getattr(self, section)]
            if sorted(listed) != sorted(names):
                raise ValueError(f"{section} names arms {listed}, the record has {names}")
        optional = ("own_shards", "drift", "probes", "loss_scaling", "memory", "performance")
        for section in (*optional, "step_masters"):
            unknown = {item.arm for item in getattr(self, section)} - set(names)
            if unknown:
                raise ValueError(f"{section} names arms the record does not have: {unknown}")
        return self

    signature: Signature | None = Field(
        None, exclude=True, description="Keyed signature of the digest; outside the digest"
    )
    upgraded_from: int | None = Field(
        None,
        exclude=True,
        description="In memory only: the schema the file was written in, where load upgraded "
        "it (the file is never rewritten)",
    )
    _absent: frozenset[str] = PrivateAttr(default_factory=frozenset)
    """Rule inputs the file's schema lacked (qualify/evidence/rejudge.py)."""
    _rejudged: Any = PrivateAttr(default=None)
    """(id of the record, its rejudge.Rejudged): what load found, for review's reuse."""

    def __eq__(self, other: object) -> bool:
        """Equal fields (the signature and upgraded_from too); the caches above never count."""
        if not isinstance(other, Record):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]


def json_schema() -> dict[str, Any]:
    return Record.model_json_schema()


if __name__ == "__main__":
    SCHEMA_PATH.write_text(json.dumps(json_schema(), indent=2) + "\n")
    print(f"wrote {SCHEMA_PATH}")
