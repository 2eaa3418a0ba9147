"""Turn every rank's observations into a record: raw observations, then derived checks.

The record stores what the ranks observed (merged over ranks where that is a
sum or a maximum, per rank where the ranks must agree); ``checks.derive``
turns that into checks and a verdict, here and again on every load. Speed is
reported, not judged, unless the plan has a ``min_speedup``: speed is gated
against a baseline record by ``compare`` (the regression gate).
"""

from __future__ import annotations

import datetime
import math
import pathlib
import re
from typing import Any

from qwz.qualify import checks as derived
from qwz.qualify import ledger, provenance
from qwz.qualify.record import Environment, Record, seal
from qwz.qualify.runner import CALIBRATION, REFERENCE, RunPlan, empty_observation, plan_dict
from qwz.tolerance import master_drift_bound


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
            "kernels": "compiled" if plan.compile_kernels else "eager",
            "integration_enabled": plan.integration_enabled,
            "config": plan.arm_config(arm),
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
    head: dict[str, Any],
    environment: Environment,
    arm: dict[str, Any],
    per_rank: list[str | None],
) -> dict[str, Any]:
    if ledger_dir is None or None in per_rank or len(set(per_rank)) != 1:
        return {"ledger_status": "not-checked", "ledger_previous": None, "ledger_siblings": {}}
    result = ledger.check_and_record(
        ledger_dir,
        head_sha=head["sha"],
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
        arm={key: value for key, value in arm.items() if key != "role"}
        | {"shard_alignment": plan.shard_alignment},
        final_hash=per_rank[0],
    )
    return {
        "ledger_status": result.status,
        "ledger_previous": result.previous,
        "ledger_siblings": dict(result.siblings),
    }


def build_record(
    plan: RunPlan,
    observations: list[dict[str, Any]],
    *,
    ledger_dir: pathlib.Path | None = None,
    min_speedup: float | None = None,
) -> Record:
    """Assemble the raw observations of every rank, derive the checks, seal the record."""
    first = observations[0]
    environment = Environment(**first["environment"])
    arms = _arms(plan)
    per_arm = {arm["name"]: [item["arms"][arm["name"]] for item in observations] for arm in arms}

    trajectories, step_one, updates, own_shards, drift, hashes, probes, memory = (
        [] for _ in range(8)
    )
    reference_bytes = per_arm[REFERENCE][0]["gather_bytes"]
    for arm in arms:
        name = arm["name"]
        ranks = per_arm[name]
        lead = ranks[0]
        trajectories.append(
            {
                "arm": name,
                "steps_planned": plan.steps,
                "losses": [_json_float(value) for value in lead["losses"]],
                "grad_norms": [_json_float(value) for value in lead["grad_norms"]],
                "held_out": [
                    {"step": step, "loss": _json_float(loss)} for step, loss in lead["held_out"]
                ],
                "failure": lead["failure"],
            }
        )
        step_one.append({"arm": name, "digests": lead["step1_digests"]})
        rank_updates = [item["update"] for item in ranks if item["update"] is not None]
        updates.append(
            {
                "arm": name,
                "samples_per_shard": plan.update_samples,
                "checked": sum(item["checked"] for item in rank_updates),
                "violations": sum(item["violations"] for item in rank_updates),
                "max_ratio": max((item["max_ratio"] for item in rank_updates), default=0.0),
                "first_violation": _violation(
                    _earliest([item["first_violation"] for item in rank_updates])
                ),
                "missing_steps": [
                    [step, rank]
                    for rank, item in enumerate(rank_updates)
                    for step in item["missing_steps"]
                ],
            }
        )
        rank_own = [item["own_shard"] for item in ranks]
        if arm["role"] != "calibration":
            present = [item for item in rank_own if item is not None]
            worst = max((item["max_ratio"] for item in present), default=0.0)
            own_shards.append(
                {
                    "arm": name,
                    "max_ratio": _json_float(worst),
                    "first_violation": _violation(
                        _earliest([item["first_violation"] for item in present])
                    ),
                }
            )
        if name != REFERENCE:
            drift.append(
                {
                    "arm": name,
                    "samples_per_param": plan.samples_per_param,
                    "max_abs_error": [float(value) for value in lead["drift_max_abs"]],
                    "bound": [
                        master_drift_bound(step, plan.lr, plan.adamw.betas)
                        for step in range(1, len(lead["drift_max_abs"]) + 1)
                    ],
                }
            )
        per_rank = [item["final_hash"] for item in ranks]
        hashes.append(
            {
                "arm": name,
                "per_rank": per_rank,
                "divergence": lead["replica_divergence"],
                **_ledger_fields(plan, ledger_dir, first["head"], environment, arm, per_rank),
            }
        )
        if arm["quantized"]:
            probes.append(
                {
                    "arm": name,
                    "requested_group_size": arm["group_size"],
                    "reported_group_sizes": [item["group_size"] for item in ranks],
                    "gather_bytes_per_step": lead["gather_bytes"],
                    "reference_gather_bytes_per_step": reference_bytes,
                }
            )
        memory += [
            {"arm": name, "rank": item["rank"], **per_arm[name][index]["memory"]}
            for index, item in enumerate(observations)
        ]

    performance = []
    for arm in arms:
        blocks = first["timings"].get(arm["name"])
        if not blocks:
            continue
        raw = [
            {
                "order": block["order"],
                "reference_times_s": block["reference_times"],
                "candidate_times_s": block["candidate_times"],
            }
            for block in blocks
        ]
        performance.append(
            {
                "arm": arm["name"],
                "block_steps": plan.block_steps,
                "warmup_steps": plan.warmup_steps,
                **derived.summarize_blocks(raw),
                "memory": [item for item in memory if item["arm"] == arm["name"]],
            }
        )

    payload = {
        "schema_version": 2,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "head": first["head"],
        "subject": first["subject"],
        "environment": environment.model_dump(),
        "workload": {
            "name": plan.workload.name,
            "params": plan.workload.params,
            "num_parameters": first["num_parameters"],
            "steps": plan.steps,
            "seed": plan.seed,
        },
        "plan": _plan_data(plan, min_speedup),
        "arms": arms,
        "trajectories": trajectories,
        "learning": {
            "eval_steps": plan.eval_steps,
            "held_out_batches_per_rank": plan.held_out_batches,
            "calibration_arm": next(
                (arm.name for arm in plan.arms if arm.noise_group_size is not None), None
            ),
            "calibration_group_size": max(plan.group_sizes) if plan.calibrate else None,
        },
        "step_one": step_one,
        "updates": updates,
        "own_shards": own_shards,
        "drift": drift,
        "hashes": hashes,
        "probes": probes,
        "memory": memory,
        "performance": performance,
    }
    return seal(payload)


_RANK = re.compile(r"--- rank (\d+) ---")
_STEP = re.compile(r"step (\d+)")


def build_failure_record(plan: RunPlan, world_size: int, message: str) -> Record:
    """A FAIL record for a run whose ranks crashed or hung (the launcher's `message` holds the
    failing rank's traceback): every arm is marked failed with what can be recovered -- the
    rank, the step when the error names one, and the error's last line."""
    ranks = [int(match) for match in _RANK.findall(message)] or [0]
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "the ranks failed without a message"
    steps = _STEP.findall(message)
    failure = {
        "step": int(steps[-1]) if steps else 0,
        "rank": ranks[0],
        "ranks": sorted(set(ranks)),
        "kind": "crash",
        "message": last[:2000],
        "parameters": [],
    }
    environment = provenance.environment([provenance.device_name()] * world_size)
    empty = empty_observation(failure)
    observations = [
        {
            "rank": rank,
            "world_size": world_size,
            "num_parameters": 0,
            "device_name": environment.device_names[rank],
            "arms": {arm.name: empty for arm in plan.arms},
            "timings": {},
            "head": provenance.git_head().model_dump(),
            "subject": provenance.subject(plan.subject).model_dump(),
            "environment": environment.model_dump(),
        }
        for rank in range(world_size)
    ]
    return build_record(plan, observations)
