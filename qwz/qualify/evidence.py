"""Turn every rank's observations into checks, a verdict and a sealed record.

Each check carries its numbers; the verdict is the conjunction of the checks.
Performance and memory are reported, not judged, unless ``min_speedup`` is
given: speed is gated against a baseline record by ``compare`` (the regression
gate), never by a fixed threshold that depends on the machine.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import statistics
from typing import Any

from qwz.qualify import ledger, stats
from qwz.qualify.record import (
    Arm,
    Block,
    Check,
    Environment,
    Hashes,
    Memory,
    Performance,
    Probe,
    Record,
    Tolerance,
    Trajectory,
    Workload,
    seal,
    verdict_of,
)
from qwz.qualify.runner import REFERENCE, RunPlan

BOUND_TEXT = (
    "|w_q - w_ref| <= 2*lr*sum_k C_k + scale/2 + half-ulp(w_ref) + half-ulp(w_q) "
    "(qwz/tolerance.py, [Note: parameter-sample tolerance]); and on every rank's own shard "
    "|w_q - master| <= scale/2 + half-ulp, exact elements bit-equal"
)


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def _json_floats(values: list[float]) -> list[float | None]:
    """JSON has no NaN or Infinity: non-finite values are recorded as null."""
    return [value if math.isfinite(value) else None for value in values]


def build_record(
    plan: RunPlan,
    observations: list[dict[str, Any]],
    *,
    ledger_dir: pathlib.Path | None = None,
    min_speedup: float | None = None,
) -> Record:
    """Assemble the checks and seal the record (see record.py)."""
    first = observations[0]
    environment = Environment(**first["environment"])
    arms = [
        Arm(
            name=arm.name,
            quantized=arm.quantized,
            group_size=arm.group_size,
            stage=plan.stage,
            dtype=plan.dtype,
            kernels="compiled" if plan.compile_kernels else "eager",
            integration_enabled=plan.integration_enabled,
            config=plan.arm_config(arm),
        )
        for arm in plan.arms
    ]
    checks: list[Check] = []
    trajectories = []
    for arm in arms:
        losses, norms = first["losses"][arm.name], first["grad_norms"][arm.name]
        trajectories.append(
            Trajectory(arm=arm.name, losses=_json_floats(losses), grad_norms=_json_floats(norms))
        )
        finite = _finite(losses) and _finite(norms)
        checks.append(
            Check(
                name=f"finite[{arm.name}]",
                passed=finite,
                detail=f"{len(losses)} losses and grad norms, all finite: {finite}",
                numbers={"steps": len(losses), "last_loss": _json_floats(losses[-1:])},
            )
        )

    tolerance = []
    for arm in arms[1:]:
        totals = dict(first["tolerance"][arm.name])
        own_shard = max(item["tolerance"][arm.name]["own_shard_max_ratio"] for item in observations)
        totals["own_shard_max_ratio"] = own_shard if math.isfinite(own_shard) else None
        tolerance.append(
            Tolerance(
                arm=arm.name,
                bound=BOUND_TEXT,
                samples_per_step=totals["checked"] // max(1, plan.steps),
                steps=plan.steps,
                **totals,
            )
        )
        own_ok = math.isfinite(own_shard) and own_shard <= 1.0
        checks.append(
            Check(
                name=f"tolerance[{arm.name}]",
                passed=totals["violations"] == 0 and totals["checked"] > 0 and own_ok,
                detail=(
                    f"{totals['violations']} violations in {totals['checked']} sampled "
                    f"elements over {plan.steps} steps; worst error/bound "
                    f"{totals['max_ratio']:.3g}; every rank's own shard vs its fp32 master: "
                    f"worst error / (scale/2 + cast half-ulp) {own_shard:.3g} (must be <= 1)"
                ),
                numbers=dict(totals),
            )
        )

    hashes = []
    for arm in arms:
        per_rank = [item["hashes"][arm.name] for item in observations]
        consistent = len(set(per_rank)) == 1
        checks.append(
            Check(
                name=f"replicas[{arm.name}]",
                passed=consistent,
                detail=(
                    f"final parameter hash equal on all {len(per_rank)} ranks: {per_rank[0][:16]}"
                    if consistent
                    else "ranks disagree: " + ", ".join(h[:16] for h in per_rank)
                ),
                numbers={"per_rank": per_rank},
            )
        )
        status, previous = "not-checked", None
        if ledger_dir is not None and consistent:
            result = ledger.check_and_record(
                ledger_dir,
                head_sha=first["head"]["sha"],
                fingerprint=environment.fingerprint(),
                workload={
                    "name": plan.workload.name,
                    "params": plan.workload.params,
                    "steps": plan.steps,
                    "seed": plan.seed,
                    "subject": plan.subject,
                },
                arm=arm.model_dump(),
                final_hash=per_rank[0],
            )
            status, previous = result.status, result.previous
            others = "".join(
                f"; {'same hash as' if other == per_rank[0] else 'differs from'} the "
                f"{description} arm's {other[:16]}"
                for description, other in result.siblings.items()
            )
            detail = {
                "reproduced": f"reproduced the ledger's hash {per_rank[0][:16]}",
                "recorded": "first run of this head, environment and arm: hash recorded",
                "mismatch": (
                    f"MISMATCH: this run {per_rank[0][:16]}, ledger {str(previous)[:16]} "
                    "for the same head and environment"
                    + (
                        " (the head is dirty: uncommitted changes)"
                        if first["head"]["dirty"]
                        else ""
                    )
                ),
            }[status] + others
            checks.append(
                Check(
                    name=f"reproduced[{arm.name}]",
                    passed=status != "mismatch",
                    detail=detail,
                    numbers={"this_run": per_rank[0], "ledger": previous},
                )
            )
        hashes.append(
            Hashes(arm=arm.name, per_rank=per_rank, ledger_status=status, ledger_previous=previous)
        )

    probes = []
    reference_bytes = first["gather_bytes"][REFERENCE]
    for arm in arms[1:]:
        reported = [item["group_sizes"][arm.name] for item in observations]
        sent = first["gather_bytes"][arm.name]
        probes.append(
            Probe(
                arm=arm.name,
                requested_group_size=arm.group_size,
                reported_group_sizes=reported,
                gather_bytes_per_step=sent,
                reference_gather_bytes_per_step=reference_bytes,
            )
        )
        checks.append(
            Check(
                name=f"probe[{arm.name}]",
                passed=all(size == arm.group_size for size in reported),
                detail=f"requested group size {arm.group_size}, ranks report {reported}",
                numbers={"requested": arm.group_size, "reported": reported},
            )
        )
        # With one rank nothing travels; the gather still quantizes, as the probe shows.
        single_rank = environment.world_size == 1
        in_effect = reported == [arm.group_size] if single_rank else 0 < sent < reference_bytes
        checks.append(
            Check(
                name=f"in-effect[{arm.name}]",
                passed=in_effect,
                detail=(
                    f"weight gather sends {sent} bytes per step vs {reference_bytes} "
                    f"unquantized ({sent / max(1, reference_bytes):.4f}x)"
                    if in_effect
                    else "quantized weights requested but not in effect: the weight gather "
                    f"sent {sent} bytes per step, the unquantized reference {reference_bytes}"
                ),
                numbers={"bytes": sent, "reference_bytes": reference_bytes},
            )
        )

    performance = []
    memory = [Memory(rank=item["rank"], **item["memory"]) for item in observations]
    for arm in arms[1:]:
        blocks = [stats.BlockTiming(**block) for block in first["timings"][arm.name]]
        summary = stats.summarize(blocks)
        performance.append(
            Performance(
                arm=arm.name,
                block_steps=plan.block_steps,
                warmup_steps=plan.warmup_steps,
                blocks=[
                    Block(
                        index=index,
                        order=block.order,
                        reference_step_s=statistics.median(block.reference_times),
                        candidate_step_s=statistics.median(block.candidate_times),
                        speedup=speedup,
                    )
                    for index, (block, speedup) in enumerate(
                        zip(blocks, summary.speedups, strict=True)
                    )
                ],
                median_speedup=summary.median_speedup,
                ci_low=summary.ci_low,
                ci_high=summary.ci_high,
                ci_method=summary.ci_method,
                p_value=summary.p_value,
                test=summary.test,
                memory=memory,
            )
        )
        if min_speedup is not None:
            checks.append(
                Check(
                    name=f"speedup[{arm.name}]",
                    passed=summary.ci_low >= min_speedup,
                    detail=(
                        f"median {summary.median_speedup:.4f}x, 95% interval "
                        f"[{summary.ci_low:.4f}, {summary.ci_high:.4f}]; required lower "
                        f"end >= {min_speedup}"
                    ),
                    numbers={"median": summary.median_speedup, "ci_low": summary.ci_low},
                )
            )

    payload = {
        "schema_version": 1,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "head": first["head"],
        "subject": first["subject"],
        "environment": environment.model_dump(),
        "workload": Workload(
            name=plan.workload.name,
            params=plan.workload.params,
            num_parameters=first["num_parameters"],
            steps=plan.steps,
            seed=plan.seed,
        ).model_dump(),
        "arms": [arm.model_dump() for arm in arms],
        "trajectories": [item.model_dump() for item in trajectories],
        "tolerance": [item.model_dump() for item in tolerance],
        "hashes": [item.model_dump() for item in hashes],
        "probes": [item.model_dump() for item in probes],
        "performance": [item.model_dump() for item in performance],
        "checks": [item.model_dump() for item in checks],
        "verdict": verdict_of(checks).model_dump(),
    }
    return seal(payload)
