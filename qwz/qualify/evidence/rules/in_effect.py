"""``in-effect[arm]``: quantized weights requested and in effect -- the candidate's weight
gather sends (or, where the record holds received bytes, receives) fewer bytes than the
unquantized reference's ([Note: received bytes per process group] in evidence/wire.py)."""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.rules.group_size_on_wire import measured_groups, uncounted
from qwz.qualify.evidence.schema import Check, Probe
from qwz.qualify.evidence.wire import received_rule

ONE_RANK = (
    "one rank: nothing was quantized or sent (the weight gather is a local copy), so "
    "the quantized gather was not tested; run with --world-size 2 or more"
)
"""[Note: one rank] (DESIGN.md: "one rank is INCONCLUSIVE"): with one rank the candidate
arms run no quantized gather at all, so every check of them passes vacuously; each
candidate's ``in-effect`` is inconclusive, and so is the verdict."""


def _in_effect_received(probe: Probe, failure: Any, name: str) -> Check:
    """[Note: received bytes per process group]: on every rank and process group the
    candidate's gather receives fewer bytes than the reference's on the same."""
    reference = {(item.rank, tuple(item.group_ranks)): item for item in probe.reference_wire}
    measured = measured_groups(probe)
    if not measured and failure is not None:
        return check(name, "n/a", "the arm failed before a gather was measured")
    pairs, unmatched = [], []
    for group in measured:
        key = (group.rank, tuple(group.group_ranks))
        if key in reference and reference[key].received_bytes_per_step is not None:
            pairs.append((group, reference[key].received_bytes_per_step))
        else:
            unmatched.append(f"rank {group.rank} over ranks {group.group_ranks}")
    if unmatched:  # the arms disagree on their process groups: nothing to compare with
        return check(
            name, "inconclusive", f"no reference gather to compare with for {', '.join(unmatched)}"
        )
    received = sum(group.received_bytes_per_step or 0 for group, _ in pairs)
    reference_total = sum(bytes_ for _, bytes_ in pairs)
    numbers = {"received_bytes": received, "reference_received_bytes": reference_total}
    short = [
        f"rank {group.rank} over ranks {group.group_ranks}: {group.received_bytes_per_step:,} B "
        f"vs {bytes_:,} B unquantized"
        for group, bytes_ in pairs
        if not 0 < (group.received_bytes_per_step or 0) < bytes_
    ]
    if pairs and not short:
        return check(
            name,
            "pass",
            f"on every rank and process group the weight gather receives fewer bytes than the "
            f"unquantized reference's: {received:,} B per step vs {reference_total:,} B "
            f"({received / reference_total:.4f}x)",
            **numbers,
        )
    return check(
        name,
        "fail",
        "quantized weights requested but not in effect: "
        + ("; ".join(short[:4]) if short else "no quantized elements on the wire were measured"),
        **numbers,
    )


@rule("in-effect", 2)
def in_effect(probe: Probe, world_size: int, failure: Any) -> Check:
    """Quantized weights requested and in effect: the candidate's weight gather sends fewer
    bytes than the unquantized reference's."""
    sent, reference_bytes = probe.gather_bytes_per_step, probe.reference_gather_bytes_per_step
    name = f"in-effect[{probe.arm}]"
    if world_size == 1:
        return check(name, "inconclusive", ONE_RANK)
    incomplete = uncounted(probe, name)
    if incomplete is not None:
        return incomplete
    if received_rule(probe) and probe.reference_wire:
        return _in_effect_received(probe, failure, name)
    if failure is not None and sent == 0:
        return check(name, "n/a", "the arm failed before a gather was measured")
    if 0 < sent < reference_bytes:
        return check(
            name,
            "pass",
            f"weight gather sends {sent} bytes per step vs {reference_bytes} "
            f"unquantized ({sent / reference_bytes:.4f}x)",
            bytes=sent,
            reference_bytes=reference_bytes,
        )
    return check(
        name,
        "fail",
        "quantized weights requested but not in effect: the weight gather sent "
        f"{sent} bytes per step, the unquantized reference {reference_bytes}",
        bytes=sent,
        reference_bytes=reference_bytes,
    )
