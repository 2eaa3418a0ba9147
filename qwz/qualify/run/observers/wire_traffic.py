"""What each step's weight gather carried, per process group ([Note: the wire window],
qualify/run/wire_window.py; [Note: wire accounting below every entry point],
qwz/integrations/probe.py), beside the spec's counts of this rank's own-shard elements there
([Note: group size from the wire], qualify/evidence/wire.py): the ``gather_bytes``, ``wire``
and ``uncounted`` fields of an arm's observation.
"""

from __future__ import annotations

from typing import Any

from qwz.integrations.probe import WireProbe
from qwz.qualify.evidence import spec
from qwz.qualify.run import replicas
from qwz.qualify.run.observers.arm_observer import ArmObserver, Window


def wire_layout(
    shards: list, group_ranks: list[tuple[int, ...]], numel: dict[str, int], keys: dict[str, str]
) -> dict[tuple[int, ...], dict[str, Any]]:
    """Per process group, the spec's counts of this rank's own-shard elements there
    ([Note: group size from the wire], qualify/evidence/wire.py): quantized (parameters above
    spec.EXACT_MAX_NUMEL), exact (at most: :func:`spec.travels_exactly`), padding (no
    parameter) and the working element
    size, and which parameters they are (dense, expert: [Note: replica sets], replicas.py)."""
    layout: dict[tuple[int, ...], dict[str, Any]] = {}
    for shard, ranks in zip(shards, group_ranks, strict=True):
        counts = layout.setdefault(
            ranks,
            {"quantized_numel": 0, "exact_numel": 0, "padding_numel": 0, "element_bytes": 0},
        )
        kind = replicas.wire_kind([slot.name for slot in shard.slots], keys)
        counts["params"] = kind if counts.get("params", kind) == kind else "mixed"
        covered = 0
        for slot in shard.slots:
            kind = "exact_numel" if spec.travels_exactly(numel[slot.name]) else "quantized_numel"
            counts[kind] += slot.end - slot.start
            covered += slot.end - slot.start
        counts["padding_numel"] += shard.master.numel() - covered
        counts["element_bytes"] = shard.working.element_size()
    return layout


def _entries(probe: WireProbe, layout: dict, rank: int) -> list[dict[str, Any]]:
    """This step's weight-gather traffic per process group ([Note: wire accounting below
    every entry point], qwz/integrations/probe.py), with the group's counts."""
    wire = []
    for ranks, counts in layout.items():
        traffic = probe.gather_traffic(ranks)
        wire.append(
            {
                "rank": rank,
                "group_ranks": list(ranks),
                "bytes_per_step": traffic.sent_bytes,
                "calls_per_step": traffic.calls,
                "received_bytes_per_step": traffic.received_bytes,
                "rows_per_step": traffic.rows,
                **counts,
            }
        )
    return wire


class WireTraffic(ArmObserver):
    """The wire observer: the bytes are those of the last step that gathered (an fp16
    overflow skip gathers nothing); a collective the probe could not attribute, on any step,
    makes the account incomplete."""

    def __init__(self, layout: dict[tuple[int, ...], dict[str, Any]], rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.largest_outputs: dict[tuple[int, ...], int] = {}
        """Per process group, the largest weight-gather collective output of any window
        ([Note: the staging bound], evidence/staging.py)."""
        self.observed: dict[str, Any] = {}

    def window_closed(self, window: Window) -> None:
        probe = window.probe
        if probe is None:
            return
        for ranks in self.layout:
            largest = probe.gather_traffic(ranks).largest_output_bytes
            self.largest_outputs[ranks] = max(self.largest_outputs.get(ranks, 0), largest)
        if window.gathered:
            self.observed["gather_bytes"] = int(probe.bytes["gather"])
            self.observed["wire"] = [
                entry | {"largest_output_bytes": self.largest_outputs[tuple(entry["group_ranks"])]}
                for entry in _entries(probe, self.layout, self.rank)
            ]
        for name, count in probe.uncounted.items():
            uncounted = self.observed.setdefault("uncounted", {})
            uncounted[name] = uncounted.get(name, 0) + count

    def report(self) -> dict[str, Any]:
        return dict(self.observed)
