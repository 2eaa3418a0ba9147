"""The report's sections on what the ranks observed: the own shards and updates against the
contract, the drift from the reference, the final hashes, the wire and the memory. Each
function returns markdown lines for ``report.render_markdown``, read from the record alone.
"""

from __future__ import annotations

from qwz.qualify.evidence.schema import Record
from qwz.qualify.review.formatting import (
    format_bytes,
    format_sig,
    group_size_text,
    short_hash,
    table,
    yes_no,
)


def _own_shard(ratio: float | None) -> str:
    return "**inf** (an exact element was not exact)" if ratio is None else format_sig(ratio, 4)


def exactness_section(record: Record) -> list[str]:
    step_one = {item.arm: item.digests for item in record.step_one}
    own = {item.arm: item for item in record.own_shards}
    rows = []
    for updates in record.updates:
        first = updates.first_violation
        own_item = own.get(updates.arm)
        rows.append(
            (
                f"`{updates.arm}`",
                "—"
                if step_one.get(updates.arm) is None
                else f"{len(step_one[updates.arm])} digests",
                f"{updates.checked:,}",
                f"**{updates.violations:,}**" if updates.violations else "0",
                format_sig(updates.max_ratio, 3),
                "—"
                if first is None
                else f"step {first.step}, rank {first.rank}, {first.parameter}: {first.what}",
                "—" if own_item is None else _own_shard(own_item.max_ratio),
            )
        )
    return [
        "## Exactness",
        "",
        "Step-1 masters: a layout-independent digest per parameter, compared with the "
        "reference's by the `step1-exact` checks. Updates: sampled master elements per rank "
        "and step against AdamW recomputed in float64 from the arm's own gradient and state "
        "([Note: exact update check], qwz/qualify/run/observers/update.py). Own shard: every "
        "rank's own shard against the spec's decode of its master "
        "(qwz/qualify/evidence/spec.py), after every step; the column is the worst error / "
        "(scale/2 + 2**-15 scale + cast half-ulp), "
        "context (<= 1).",
        "",
        *table(
            ["arm", "step-1 masters", "updates checked", "violations", "worst ratio",
             "first violation", "own shard vs master (<= 1)"],
            rows,
        ),
        *_kernels_lines(record),
    ]  # fmt: skip


def _kernels_lines(record: Record) -> list[str]:
    """Which wire kernels each arm ran on each rank, and every implementation dropped: two
    kernel implementations that disagree are never hidden in a log."""
    lines = []
    for own in record.own_shards:
        ran = sorted(
            {f"{use.kernels or 'none'}{' (native C)' if use.native else ''}" for use in own.kernels}
        )
        dropped = sorted({f"rank {use.rank}: {r}" for use in own.kernels for r in use.fallbacks})
        if ran:
            lines.append(f"Kernels of `{own.arm}`: {', '.join(ran)}.")
        if dropped:
            lines.append(f"**Kernel fallbacks of `{own.arm}`:** {'; '.join(dropped)}.")
    return ["", *lines, ""] if lines else []


def _worst_drift(errors: list[float | None]) -> str:
    """The largest drift, or "not finite" where a sampled weight was not (null)."""
    if not errors:
        return "—"
    if None in errors:
        return "not finite"
    return format_sig(max(errors), 3)


def drift_section(record: Record) -> list[str]:
    if not record.drift:
        return []
    rows = [
        (
            f"`{drift.arm}`",
            drift.samples_per_param,
            _worst_drift(drift.max_abs_error),
            "—" if not drift.bound else format_sig(drift.bound[-1], 3),
        )
        for drift in record.drift
    ]
    return [
        "## Drift from the reference (context)",
        "",
        "Sampled working weights against the reference's at the same step. The bound holds "
        "for any two AdamW trajectories (qwz/qualify/evidence/tolerance.py), so it is context, "
        "not a check.",
        "",
        *table(["arm", "samples/parameter", "max abs difference", "bound at last step"], rows),
    ]


def memory_section(record: Record) -> list[str]:
    if not record.memory:
        return []
    return [
        "## Peak memory per arm",
        "",
        "Each arm runs alone, from a reset of the peak (CUDA peak statistics, or the "
        "process's peak RSS): one arm's own peak per rank.",
        "",
        *table(
            ["arm", "rank", "kind", "peak allocated", "peak reserved"],
            [
                (
                    f"`{memory.arm}`",
                    memory.rank,
                    memory.kind,
                    format_bytes(memory.peak_allocated_bytes),
                    "—"
                    if memory.peak_reserved_bytes is None
                    else format_bytes(memory.peak_reserved_bytes),
                )
                for memory in record.memory
            ],
        ),
    ]


def hashes_section(record: Record) -> list[str]:
    rows = []
    for hashes in record.hashes:
        distinct = list(dict.fromkeys(hashes.per_rank))
        agree = len(distinct) == 1
        if len(hashes.replica_sets) > 1:  # experts: each set's ranks must agree
            agree = all(len(set(item.hashes)) == 1 for item in hashes.replica_sets)
        if hashes.divergence is not None:
            per_rank = f"**diverged after step {hashes.divergence.step}**"
        elif len(hashes.replica_sets) > 1:
            per_rank = "; ".join(
                f"{item.params} (ranks {', '.join(map(str, item.ranks))}): "
                + ", ".join(f"`{short_hash(value)}`" for value in dict.fromkeys(item.hashes))
                for item in hashes.replica_sets
            )
        elif len(distinct) == 1:
            per_rank = f"`{short_hash(distinct[0])}` on all {len(hashes.per_rank)} ranks"
        else:
            per_rank = ", ".join(
                f"rank {rank}: `{short_hash(value)}`" for rank, value in enumerate(hashes.per_rank)
            )
        rows.append(
            (
                f"`{hashes.arm}`",
                per_rank,
                yes_no(agree),
                hashes.ledger_status,
                f"`{short_hash(hashes.ledger_previous)}`" if hashes.ledger_previous else "—",
            )
        )
    return [
        "## Replica hashes",
        "",
        "Final parameter hash per rank (with experts: per set of ranks holding the same "
        "parameters, [Note: replica sets]); the ledger holds earlier records' hashes for the "
        "same head and environment (`reproduced`: equal to an earlier one).",
        "",
        *table(["arm", "final hash", "ranks agree", "ledger", "earlier hash"], rows),
    ]


def probe_section(record: Record) -> list[str]:
    rows = []
    for probe in record.probes:
        reported = ", ".join(
            f"rank {rank}: {group_size_text(size)}"
            for rank, size in enumerate(probe.reported_group_sizes)
        )
        sources = sorted({source for source in probe.reported_by if source})
        if sources:
            reported += f" ({', '.join(f'`{source}`' for source in sources)})"
        reference_bytes = probe.reference_gather_bytes_per_step
        ratio = f"{probe.gather_bytes_per_step / reference_bytes:.3f}x" if reference_bytes else "—"
        rows.append(
            (
                f"`{probe.arm}`",
                group_size_text(probe.requested_group_size),
                reported,
                f"{probe.gather_bytes_per_step:,}",
                f"{reference_bytes:,}",
                ratio,
            )
        )
    return [
        "## Config probe",
        "",
        "The group size each rank's subject reports (where it reports one), and the bytes "
        "rank 0 sends in the weight gather per step.",
        "",
        *table(
            [
                "arm",
                "requested group size",
                "reported group size",
                "gather bytes/step (rank 0)",
                "reference gather bytes/step",
                "ratio",
            ],
            rows,
        ),
        *_wire_table(record),
    ]


def _wire_table(record: Record) -> list[str]:
    """Per arm, rank and process group: the group size the bytes imply and the bytes that
    groups of the requested size allow ([Note: group size from the wire])."""
    from qwz.qualify.evidence.wire import group_bounds, wire_group_size

    rows = []
    for probe in record.probes:
        for group in probe.wire:
            implied = wire_group_size(probe.wire, group)
            fewest, most = group_bounds(probe.wire, group, probe.requested_group_size or 1)
            rows.append(
                (
                    f"`{probe.arm}`",
                    group.rank,
                    ", ".join(map(str, group.group_ranks)),
                    group.params,
                    f"{group.quantized_numel:,} / {group.exact_numel:,}",
                    f"{group.bytes_per_step:,}",
                    "—" if implied is None else f"{implied:.1f}",
                    group_size_text(probe.requested_group_size),
                    f"{fewest:,} – {most:,}",
                )
            )
    if not rows:
        return []
    return [
        "The group size the wire's bytes imply (the spec's 1 + 4/G bytes per quantized "
        "element), per rank and process group, and the bytes groups of the requested size "
        "allow (qualify/evidence/wire.py, [Note: group size from the wire]).",
        "",
        *table(
            [
                "arm",
                "rank",
                "process group",
                "parameters",
                "quantized / exact elements",
                "gather bytes/step",
                "G from the wire",
                "requested G",
                "bytes allowed",
            ],
            rows,
        ),
    ]
