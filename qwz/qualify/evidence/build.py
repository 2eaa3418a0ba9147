"""Turn every rank's observations into a record: raw observations, then derived checks.

The record stores what the ranks observed (merged over ranks where that is a
sum or a maximum, per rank where the ranks must agree); ``checks.derive``
turns that into checks and a verdict, here and again on every load. Speed is
reported, not judged, unless the plan has a ``min_speedup``: speed is gated
against a baseline record by ``compare`` (the regression gate).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
from typing import Any

import torch

from qwz.qualify.base.plan import CALIBRATION, REFERENCE, RunPlan, plan_dict
from qwz.qualify.base.rank_reports import RankEnd
from qwz.qualify.evidence import ledger, provenance
from qwz.qualify.evidence.observation import ArmObservation
from qwz.qualify.evidence.optimizer import AdamWSettings, adamw_of
from qwz.qualify.evidence.rules.identical_replicas import arm_final_hash
from qwz.qualify.evidence.rules.speed import summarize_blocks
from qwz.qualify.evidence.schema import SCHEMA_VERSION, Environment, Head, Record, Subject
from qwz.qualify.evidence.seal import seal
from qwz.qualify.evidence.tolerance import master_drift_bound

LEDGER_LEAVES_OUT = ("role", "allgather_bucket_size")
"""Arm fields the ledger's key leaves out: the role, and the bucket its config already holds."""


def _json_float(value: float | None) -> float | None:
    """JSON has no NaN or Infinity: non-finite values are recorded as null."""
    return value if value is not None and math.isfinite(value) else None


def _role(name: str) -> str:
    if name == REFERENCE:
        return "reference"
    return "calibration" if name.startswith(CALIBRATION) else "candidate"


def _arms(plan: RunPlan) -> list[dict[str, Any]]:
    return [
        {
            "name": arm.name,
            "role": _role(arm.name),
            "quantized": arm.quantized,
            "group_size": arm.group_size,
            "stage": plan.stage,
            "dtype": plan.dtype,
            "kernels": plan.kernels,
            "qwz_gather": plan.qwz_gather,
            "config": plan.arm_config(arm),
            "allgather_bucket_size": arm.allgather_bucket_size or plan.allgather_bucket_size,
        }
        for arm in plan.arms
    ]


def _violation(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    what = raw.get("what", "")
    if raw.get("exact_required"):
        what = "a small parameter's element, which must travel exactly, is not exact"
    return {
        "step": raw["step"],
        "rank": raw["rank"],
        "parameter": raw["parameter"],
        "index": raw["index"],
        "what": what,
        "ratio": _json_float(raw.get("ratio")),
    }


def _earliest(violations: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    found = [item for item in violations if item is not None]
    return min(found, key=lambda item: (item["step"], item["rank"])) if found else None


def _plan_data(plan: RunPlan, min_speedup: float | None) -> dict[str, Any]:
    data = plan_dict(plan)
    data["min_speedup"] = min_speedup
    return data


def _ledger_fields(
    plan: RunPlan,
    ledger_dir: pathlib.Path | None,
    code: dict[str, Any],
    environment: Environment,
    arm: dict[str, Any],
    final_hash: str | None,
) -> dict[str, Any]:
    if ledger_dir is None or final_hash is None:
        return {"ledger_status": "not-checked", "ledger_previous": None, "ledger_siblings": {}}
    result = ledger.check_and_record(
        ledger_dir,
        code=code,
        fingerprint=environment.fingerprint(),
        workload={
            "name": plan.workload.name,
            "params": plan.workload.params,
            "steps": plan.steps,
            "seed": plan.seed,
            "subject": plan.subject,
        },
        # The layout is part of the computation: at W >= 3 an arm's hash depends on the
        # run's shard alignment ([Note: padding rule], qwz/layout.py), so it keys the entry.
        # The arm's bucket is in its config already: the key stays what older ledgers hold.
        arm={key: value for key, value in arm.items() if key not in LEDGER_LEAVES_OUT}
        | {"shard_alignment": plan.shard_alignment},
        final_hash=final_hash,
    )
    return {
        "ledger_status": result.status,
        "ledger_previous": result.previous,
        "ledger_siblings": dict(result.siblings),
    }


def _code_identity(first: dict[str, Any]) -> dict[str, Any]:
    """What the ledger keys hashes on besides the environment ([Note: ledger key],
    qualify/evidence/ledger.py): the subject's identity, the record's head and the harness's."""
    head, harness = Head(**first["head"]), Head(**first["harness"])
    return ledger.code_identity(Subject(**first["subject"]), head, harness)


def _held_out(entry: list[Any]) -> dict[str, Any]:
    """One evaluation of ArmObservation.held_out as the record's HeldOut."""
    step, loss, *batches = entry
    held_out: dict[str, Any] = {"step": step, "loss": _json_float(loss)}
    if batches:
        held_out["batch_losses"] = [_json_float(value) for value in batches[0]]
    return held_out


def _trajectory(plan: RunPlan, name: str, lead: ArmObservation) -> dict[str, Any]:
    return {
        "arm": name,
        "steps_planned": plan.steps,
        "losses": [_json_float(value) for value in lead.losses],
        "grad_norms": [_json_float(value) for value in lead.grad_norms],
        "held_out": [_held_out(entry) for entry in lead.held_out],
        "failure": lead.failure,
    }


def _updates(plan: RunPlan, name: str, ranks: list[ArmObservation]) -> dict[str, Any]:
    rank_updates = [item.update for item in ranks if item.update is not None]
    return {
        "arm": name,
        "samples_per_shard": plan.update_samples,
        "checked": sum(item["checked"] for item in rank_updates),
        "violations": sum(item["violations"] for item in rank_updates),
        "max_ratio": max((item["max_ratio"] for item in rank_updates), default=0.0),
        "first_violation": _violation(
            _earliest([item["first_violation"] for item in rank_updates])
        ),
        "missing_steps": [
            [step, rank] for rank, item in enumerate(rank_updates) for step in item["missing_steps"]
        ],
        # Every rank judges the same all-reduced norm: steps, not rank-steps.
        "skipped_steps": [
            [step, rank]
            for rank, item in enumerate(rank_updates)
            for step in item.get("skipped_steps", [])
        ],
        **{
            key: max((item.get(key, 0) for item in rank_updates), default=0)
            for key in ("norm_checked", "norm_violations")
        },
        "norm_max_ratio": max(
            (item.get("norm_max_ratio", 0.0) for item in rank_updates), default=0.0
        ),
        "optimizer": rank_updates[0].get("optimizer") or None if rank_updates else None,
    }


OWN_SHARD_COUNTS = (
    "checked", "mismatches", "near_ties", "working_input", "scale_ulp", "unrounded_decode",
    "fp16_overflow",
)  # fmt: skip
"""The own-shard observer's counts (qualify/run/observers/own_shard.py), summed over ranks."""


def _own_shards(name: str, ranks: list[ArmObservation]) -> dict[str, Any]:
    present = [item.own_shard for item in ranks if item.own_shard is not None]
    worst = max((item["max_ratio"] for item in present), default=0.0)
    by_scheme: dict[str, int] = {}
    for item in present:
        for scheme, count in item.get("by_scheme", {}).items():
            by_scheme[scheme] = by_scheme.get(scheme, 0) + count
    return {
        "arm": name,
        "max_ratio": _json_float(worst),
        "first_violation": _violation(_earliest([item["first_violation"] for item in present])),
        **{key: sum(item.get(key, 0) for item in present) for key in OWN_SHARD_COUNTS},
        "scheme_by_rank": [item.get("scheme") for item in present],
        "by_scheme": dict(sorted(by_scheme.items())),
        "cost": _scheme_cost([item.get("cost") for item in present]),
        # None where any rank's judge did not count it (an older observation).
        "reference": None
        if any("reference" not in item for item in present)
        else sum(item["reference"] for item in present),
        "kernels": [item.kernels for item in ranks if item.kernels],
    }


def _scheme_cost(ranks: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The record's ``cost`` (schema.SchemeCost) from every rank's measure ([Note: what a
    scheme costs], qualify/run/observers/scheme_cost.py); None where no rank measured a
    quantized element."""
    present = [item for item in ranks if item and item.get("elements")]
    if not present:
        return None
    elements = sum(item["elements"] for item in present)
    cost: dict[str, Any] = {"elements": elements, "cast_dtype": present[0]["cast_dtype"]}
    for prefix in ("written", "absmax127", "cast"):
        cost[f"{prefix}_worst"] = max(item[f"{prefix}_worst"] for item in present)
        cost[f"{prefix}_mean"] = sum(item[f"{prefix}_sum"] for item in present) / elements
    for name in ("fp16_below_normal", "fp16_overflow"):
        cost[name] = sum(item[name] for item in present)
    # A non-finite weight (an fp16 overflow's NaN) has no error to show: null, never NaN.
    return {
        name: None if isinstance(value, float) and not math.isfinite(value) else value
        for name, value in cost.items()
    }


def _drift(plan: RunPlan, name: str, lead: ArmObservation) -> dict[str, Any]:
    adamw = adamw_of(plan.arm_config(plan.arms[0]))  # the reference's; none for another
    steps = len(lead.drift_max_abs) if isinstance(adamw, AdamWSettings) else 0
    return {
        "arm": name,
        "samples_per_param": plan.samples_per_param,
        "max_abs_error": [_json_float(float(value)) for value in lead.drift_max_abs],
        "bound": [master_drift_bound(step, adamw.lr, adamw.betas) for step in range(1, steps + 1)],
    }


def _replica_sets(ranks: list[ArmObservation]) -> list[dict[str, Any]]:
    """Per replica key, the ranks that hold it and their final hashes ([Note: replica
    sets], qualify/run/replicas.py); empty when a rank has none (an arm that never ran)."""
    if any(item.final_hashes is None for item in ranks):
        return []
    sets: dict[str, dict[str, Any]] = {}
    for rank, item in enumerate(ranks):
        for key, value in item.final_hashes.items():
            entry = sets.setdefault(key, {"params": key, "ranks": [], "hashes": []})
            entry["ranks"].append(rank)
            entry["hashes"].append(value)
    return [sets[key] for key in sorted(sets)]


def _probe(
    arm: dict[str, Any], ranks: list[ArmObservation], reference: list[ArmObservation]
) -> dict:
    uncounted = sorted({name for item in (*ranks, *reference) for name in item.uncounted})
    return {
        "arm": arm["name"],
        "requested_group_size": arm["group_size"],
        "reported_group_sizes": [item.group_size for item in ranks],
        "reported_by": [item.reported_by for item in ranks],
        "wire": [entry for item in ranks for entry in item.wire],
        "gather_bytes_per_step": ranks[0].gather_bytes,
        "reference_gather_bytes_per_step": reference[0].gather_bytes,
        "reference_wire": [entry for item in reference for entry in item.wire],
        "uncounted_calls": sum(sum(item.uncounted.values()) for item in (*ranks, *reference)),
        "uncounted": uncounted,
    }


def _performance(plan: RunPlan, name: str, blocks: list[dict], memory: list[dict]) -> dict:
    raw = [
        {
            "order": block["order"],
            "reference_times_s": block["reference_times"],
            "candidate_times_s": block["candidate_times"],
            "reference_gather_s": list(block.get("reference_gather_times", [])),
            "candidate_gather_s": list(block.get("candidate_gather_times", [])),
        }
        for block in blocks
    ]
    return {
        "arm": name,
        "block_steps": plan.block_steps,
        "warmup_steps": plan.warmup_steps,
        **summarize_blocks(raw),
        "memory": [item for item in memory if item["arm"] == name],
    }


def _sections(
    plan: RunPlan,
    observations: list[dict[str, Any]],
    arms: list[dict[str, Any]],
    ledger_dir: pathlib.Path | None,
    environment: Environment,
) -> dict[str, list[dict[str, Any]]]:
    """The per-arm sections of the record, merged over the ranks (module docstring)."""
    per_arm = {arm["name"]: [item["arms"][arm["name"]] for item in observations] for arm in arms}
    code = _code_identity(observations[0])
    names = ("trajectories", "step_one", "updates", "own_shards", "drift", "hashes", "probes")
    sections: dict[str, list[dict[str, Any]]] = {
        key: [] for key in (*names, "step_masters", "loss_scaling", "memory")
    }
    for arm in arms:
        name, ranks = arm["name"], per_arm[arm["name"]]
        lead = ranks[0]
        sections["trajectories"].append(_trajectory(plan, name, lead))
        sections["step_one"].append(
            {"arm": name, "digests": lead.step1_digests, "step": lead.first_update_step}
        )
        sections["step_masters"].append({"arm": name, "digests": lead.step_digests})
        if lead.overflowed is not None:
            sections["loss_scaling"].append(
                {
                    "arm": name,
                    "scales": [[_json_float(v) for v in item.loss_scales or []] for item in ranks],
                    "overflowed": list(lead.overflowed),
                }
            )
        sections["updates"].append(_updates(plan, name, ranks))
        if arm["role"] != "calibration":
            sections["own_shards"].append(_own_shards(name, ranks))
        if name != REFERENCE:
            sections["drift"].append(_drift(plan, name, lead))
        per_rank = [item.final_hash for item in ranks]
        sets = _replica_sets(ranks)
        final_hash = arm_final_hash(per_rank, [item["hashes"] for item in sets])
        ledger_fields = _ledger_fields(plan, ledger_dir, code, environment, arm, final_hash)
        sections["hashes"].append(
            {"arm": name, "per_rank": per_rank, "divergence": lead.replica_divergence}
            | {"replica_sets": sets}
            | ledger_fields
        )
        if arm["quantized"]:
            sections["probes"].append(_probe(arm, ranks, per_arm[REFERENCE]))
        sections["memory"] += [
            {"arm": name, "rank": item["rank"], **ranks[index].memory}
            for index, item in enumerate(observations)
        ]
    return sections


def _subject(observations: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's identity of the subject, with every op any rank ran as the harness's own
    implementation ([Note: a CUDA-only subject on a CPU runner], qualify/run/quantizer_op.py)."""
    ops = sorted({op for item in observations for op in item.get("substituted_ops", [])})
    return {**observations[0]["subject"], **({"substituted_ops": ops} if ops else {})}


def build_record(
    plan: RunPlan,
    observations: list[dict[str, Any]],
    *,
    ledger_dir: pathlib.Path | None = None,
    min_speedup: float | None = None,
    invocation: dict[str, Any] | None = None,
    conformance: dict[str, Any] | None = None,
) -> Record:
    """Assemble the raw observations of every rank, derive the checks, seal the record;
    `invocation`: how the run was started ([Note: reproduce], qualify/evidence/machine.py);
    `conformance`: the PR's config rules as the subject took them ([Note: conformance run],
    qualify/run/conformance_run.py), None where the run did not put them to it."""
    first = observations[0]
    environment = Environment(**first["environment"])
    arms = _arms(plan)
    sections = _sections(plan, observations, arms, ledger_dir, environment)
    performance = [
        _performance(plan, arm["name"], first["timings"][arm["name"]], sections["memory"])
        for arm in arms
        if first["timings"].get(arm["name"])
    ]
    payload = {
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "head": first["head"],
        "harness": first["harness"],
        "subject": _subject(observations),
        "environment": environment.model_dump(),
        "invocation": invocation,
        "workload": {
            "name": plan.workload.name,
            "params": plan.workload.params,
            "num_parameters": first["num_parameters"],
            "steps": plan.steps,
            "seed": plan.seed,
        },
        "plan": _plan_data(plan, min_speedup),
        "arms": arms,
        "trajectories": sections["trajectories"],
        "learning": {
            "eval_steps": plan.eval_steps,
            "held_out_batches_per_rank": plan.held_out_batches,
            "calibration_arm": next(
                (arm.name for arm in plan.arms if arm.noise_group_size is not None), None
            ),
            "calibration_group_size": next(
                (arm.noise_group_size for arm in plan.arms if arm.noise_group_size), None
            ),
            "rule": plan.learning_rule,
        },
        **{key: sections[key] for key in ("step_one", "step_masters", "updates", "own_shards")},
        "drift": sections["drift"],
        **{key: sections[key] for key in ("hashes", "probes", "loss_scaling", "memory")},
        "performance": performance,
        "conformance": conformance,
    }
    return seal(payload)


def _crash_failure(plan: RunPlan, cause: RankEnd, context: tuple[RankEnd, ...]) -> dict:
    """The Failure of the arm a run crashed in: the rank that failed first, how, and where."""
    where = cause.where
    phase = where.get("phase")
    last = where.get("last_completed_step")
    step = where.get("step", plan.steps if phase == "timing" else 0)
    after = f" (last completed step {last})" if last is not None else ""
    on_their_own = {
        end.rank
        for end in context
        if end.how not in ("timeout", "unreported") and not end.peer_lost
    }
    return {
        "step": int(step or 0),
        "rank": cause.rank,
        "ranks": sorted({cause.rank} | on_their_own),
        "kind": "crash",
        "message": f"{cause.describe()}{after}"[:2000],
        "parameters": [],
        "last_completed_step": None if last is None else int(last),
        "phase": None if phase is None else str(phase),
        "signal": cause.signal,
        "exit_code": cause.exit_code if cause.how == "exit" else None,
        "traceback": [line[:500] for line in cause.traceback],
        "context": [f"rank {end.rank} {end.describe()}"[:2000] for end in context],
    }


def build_failure_record(
    plan: RunPlan,
    world_size: int,
    cause: RankEnd,
    context: tuple[RankEnd, ...] = (),
    results: dict[int, dict[str, Any]] | None = None,
    invocation: dict[str, Any] | None = None,
    conformance: dict[str, Any] | None = None,
) -> Record:
    """A FAIL record for a run that crashed ([Note: failures] in qualify/run/runner.py).

    `cause` is the rank that failed first, `context` how the others ended, `results` each
    rank's observations of the arms it finished ({rank: {arm: observation}}). Arms every
    rank finished keep their observations and are judged; the arm the run crashed in gets
    a "crash" failure; the arms after it are "not run"."""
    results = results or {}
    names = [arm.name for arm in plan.arms]
    finished = [
        name for name in names if all(name in results.get(r, {}) for r in range(world_size))
    ]
    crashed = cause.where.get("arm")
    if crashed not in names:
        crashed = next((name for name in names if name not in finished), names[-1])
    crash = _crash_failure(plan, cause, context)
    not_run = {
        "step": 0,
        "rank": -1,
        "ranks": [],
        "kind": "not-run",
        "message": f"not run: the run ended in {crashed} (a crash on rank {cause.rank})",
        "parameters": [],
    }

    def arm_observation(name: str, rank: int) -> ArmObservation:
        if name == crashed:
            kept = results[rank][name] if name in finished else ArmObservation()
            return dataclasses.replace(kept, failure=crash)
        if name in finished:
            return results[rank][name]
        return ArmObservation(failure=not_run)

    environment = provenance.environment(
        [provenance.device_name()] * world_size, world_size=world_size
    )
    with torch.device("meta"):
        num_parameters = sum(p.numel() for p in plan.workload.build_model(plan.seed).parameters())
    observations = [
        {
            "rank": rank,
            "world_size": world_size,
            "num_parameters": num_parameters,
            "device_name": environment.device_names[rank],
            "arms": {name: arm_observation(name, rank) for name in names},
            "timings": {},
            **provenance.code_under_test(plan.subject),
            "environment": environment.model_dump(),
        }
        for rank in range(world_size)
    ]
    return build_record(plan, observations, invocation=invocation, conformance=conformance)
