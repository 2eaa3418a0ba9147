"""``probe[arm]``: the group size the weight gather's bytes imply, held to the requested one by
the spec's wire ([Note: group size from the wire] and [Note: received bytes per process group]
in evidence/wire.py, which holds the arithmetic)."""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Check, Probe, WireGroup
from qwz.qualify.evidence.wire import (
    group_bounds,
    received_bounds,
    received_group_size,
    received_rule,
    wire_group_size,
)


def uncounted(probe: Probe, name: str) -> Check | None:
    """[Note: wire accounting below every entry point] (qwz/integrations/probe.py): an account with
    calls it could not attribute is incomplete, so neither a pass nor a fail follows from it."""
    if probe.uncounted_calls == 0:
        return None
    where = ", ".join(probe.uncounted[:6]) or "unnamed entry points"
    return check(
        name,
        "inconclusive",
        f"{probe.uncounted_calls} collective calls could not be attributed to a process "
        f"group ({where}): the wire's account is incomplete",
        uncounted_calls=probe.uncounted_calls,
    )


@rule("probe", 2)
def probe(probe: Probe, world_size: int, failure: Any) -> Check:
    """[Note: group size from the wire]; [Note: received bytes per process group]."""
    name = f"probe[{probe.arm}]"
    requested = probe.requested_group_size
    reported = probe.reported_group_sizes
    sources = sorted({source for source in probe.reported_by if source})
    said = f"; the subject reports {reported}" + (f" ({', '.join(sources)})" if sources else "")
    if world_size == 1:
        # One rank gathers exactly (nothing to save on the wire), so no group size is used:
        # nothing to test unless the subject claims one ([Note: one rank], below).
        wrong = [size for size in reported if size is not None]
        status = "fail" if wrong else "n/a"
        return check(name, status, f"one rank: the gather is exact{said}", reported=reported)
    incomplete = uncounted(probe, name)
    if incomplete is not None:
        return incomplete
    measured = measured_groups(probe)
    if not measured and failure is not None:
        return check(name, "n/a", "the arm failed before a gather was measured")
    if not measured:
        return check(name, "fail", f"no quantized elements on the wire were measured{said}")
    if received_rule(probe):
        return _probe_received(probe, measured, name, said)
    lines, outside = [], []
    for group in measured:
        fewest, most = group_bounds(probe.wire, group, requested)
        implied = wire_group_size(probe.wire, group)
        where = f"rank {group.rank} over ranks {group.group_ranks}"
        lines.append(
            f"{where}: {group.bytes_per_step:,} B for {group.quantized_numel:,} quantized + "
            f"{group.exact_numel:,} exact elements, G ~ "
            + ("none (no bytes for scales)" if implied is None else f"{implied:.0f}")
        )
        if not fewest <= group.bytes_per_step <= most:
            outside.append(f"{where}: {group.bytes_per_step:,} B outside [{fewest:,}, {most:,}]")
    fits = f"the wire's bytes fit groups of {requested} on every rank"
    sizes = [wire_group_size(probe.wire, group) for group in measured]
    return _probe_verdict(probe, name, said, lines, outside, fits, sizes)


def measured_groups(probe: Probe) -> list[WireGroup]:
    return [
        group for group in probe.wire if group.quantized_numel > 0 and len(group.group_ranks) > 1
    ]


def _probe_received(probe: Probe, measured: list[WireGroup], name: str, said: str) -> Check:
    """[Note: received bytes per process group]."""
    requested = probe.requested_group_size
    lines, outside = [], []
    for group in measured:
        fewest, most = received_bounds(probe.wire, group, requested)
        implied = received_group_size(probe.wire, group)
        received = group.received_bytes_per_step or 0
        where = f"rank {group.rank} over ranks {group.group_ranks}"
        lines.append(
            f"{where}: received {received:,} B in {group.rows_per_step or 0} peer rows, G ~ "
            + ("none (no bytes for scales)" if implied is None else f"{implied:.0f}")
        )
        if not fewest <= received <= most:
            outside.append(f"{where}: received {received:,} B outside [{fewest:,}, {most:,}]")
    fits = f"the bytes each rank received fit groups of {requested}"
    sizes = [received_group_size(probe.wire, group) for group in measured]
    return _probe_verdict(probe, name, said, lines, outside, fits, sizes)


def _probe_verdict(
    probe: Probe,
    name: str,
    said: str,
    lines: list[str],
    outside: list[str],
    fits: str,
    sizes: list[float | None],
) -> Check:
    """``probe``'s check from the bounds each measured group was held to (both rules)."""
    requested, reported = probe.requested_group_size, probe.reported_group_sizes
    disagree = [size for size in reported if size is not None and size != requested]
    status = "fail" if outside or disagree else "pass"
    if outside:
        verdict = f"the wire does not carry groups of {requested}: {'; '.join(outside)}"
    elif disagree:
        verdict = f"the subject reports {disagree[0]}, not the requested {requested}"
    else:
        verdict = fits
    # A one-rank group (experts whose expert-data-parallel group is one rank) sends nothing:
    # its gather is a local copy, exact by the spec (own-shard holds it to that).
    local = sorted(
        {tuple(group.group_ranks) for group in probe.wire if len(group.group_ranks) == 1}
    )
    if local:
        said += (
            f"; one-rank groups {', '.join(map(str, map(list, local)))}: a local copy, not judged"
        )
    return check(
        name,
        status,
        f"requested group size {requested}: {verdict} ({'; '.join(lines[:4])}){said}",
        requested=requested,
        reported=reported,
        wire_group_sizes=sizes,
    )
