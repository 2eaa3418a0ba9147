"""The weight gather's wire in bytes, by the spec's encoding (spec.py): how many bytes a rank
may send, or receive, per step over a process group for a group size, and the group size its
bytes imply. Read by ``probe`` and ``in-effect`` (rules/group_size_on_wire.py,
rules/in_effect.py) and by the report. Like spec.py, it imports nothing from the code it
judges.

[Note: group size from the wire]
``probe`` judges the group size from the bytes each rank sent in its weight gather
over each process group (qwz/integrations/probe.py counts them per group), by the spec's wire:
every quantized element is one int8 code, every group of G elements one fp32 scale
(``1 + 4/G`` bytes per quantized element), and the exact elements (those of parameters of
at most 65,536) travel in the working dtype. With ``q`` quantized, ``e`` exact and ``p``
padding elements in a rank's shard over the group, and ``c`` gather calls, the bytes
must lie in ``[q + 4*ceil(q/G) + e*b, n + c*(G-1) + 4*(ceil(n/G) + c - 1) + (e+p)*b +
3c]`` (``n = q + e + p``, ``b`` the working element size): the fewest is the spec's
encoding; the most allows an implementation to send codes for every shard position,
pad each call to whole groups and send the padding exactly. A gather's rows have one
size on every rank of its group, so each bound is the largest over the group's ranks.
The detail shows the G the bytes imply (``4q`` over the bytes beyond codes and exact
elements). A group size the subject reports ([Note: reported group size],
qualify/run/subjects.py) is shown and must equal the requested one; it never stands in for
the wire.

[Note: received bytes per process group]
A record whose wire holds received bytes (qwz/integrations/probe.py counts them below every entry
point) is judged by what each rank *received* from its peers over each process group, so
the collective is free: an all-gather into one tensor or a list, one broadcast per source,
point-to-point, an all-to-all all deliver each peer's row once. Source ``r``'s row over the
step, in ``c`` chunks (the rank's peer rows over ``W - 1``), takes at least the spec's
encoding ``q_r + 4*ceil(q_r/G) + e_r*b`` and at most ``n_r + c*(G-1) + 4*(ceil(n_r/G) + c -
1) + min(n_r, X)*max(b, 4) + c*ROW_SLACK_BYTES``, ``X`` the exact and padding elements of
all the group's ranks: codes for every position padded per chunk to whole groups, and exact
elements as fp32, per chunk padded to the rank with the most there (the per-chunk maxima
sum to at most ``X``). A rank receives at least its peers' fewest summed and at most
``W - 1`` rows of the largest most (rows padded to the fullest rank). Unquantized bf16
(``2*n_r`` a row) lies above that unless it comes in nearly a chunk per group (the ``c*(G-1)``
term), and ``in-effect`` fails it however it is chunked; fewer bytes than the codes and
scales lie below it.
``in-effect`` then compares each rank's received bytes over each group with the
reference's on the same rank and group. Calls the probe could not attribute make both
inconclusive.
"""

from __future__ import annotations

from qwz.qualify.evidence.schema import Probe, WireGroup
from qwz.qualify.evidence.spec import SCALE_BYTES

ALIGNMENT_BYTES = 3
"""Padding a gather call's row may add to keep the next row's scales aligned."""


def wire_bounds(group: WireGroup, group_size: int) -> tuple[int, int]:
    """[Note: group size from the wire]: the fewest and the most bytes a rank may send per
    step over one process group when its quantized elements travel in groups of
    `group_size`."""
    quantized, exact = group.quantized_numel, group.exact_numel
    numel = quantized + exact + group.padding_numel
    calls = max(1, group.calls_per_step)
    fewest = quantized + SCALE_BYTES * -(-quantized // group_size) + exact * group.element_bytes
    most = (
        numel
        + calls * (group_size - 1)
        + SCALE_BYTES * (-(-numel // group_size) + calls - 1)
        + (exact + group.padding_numel) * group.element_bytes
        + calls * ALIGNMENT_BYTES
    )
    return fewest, most


def group_bounds(groups: list[WireGroup], group: WireGroup, group_size: int) -> tuple[int, int]:
    """:func:`wire_bounds` for `group` given every rank's entry in `groups`: a gather sends
    rows of one size on every rank of the process group, so each rank's row is sized for
    the rank with the most to send -- the largest of the ranks' fewest and most bytes."""
    peers = [item for item in groups if item.group_ranks == group.group_ranks] or [group]
    bounds = [wire_bounds(item, group_size) for item in peers]
    return max(fewest for fewest, _ in bounds), max(most for _, most in bounds)


def wire_group_size(groups: list[WireGroup], group: WireGroup) -> float | None:
    """The group size `group`'s bytes imply by the spec's ``1 + 4/G`` bytes per quantized
    element -- every byte beyond the codes and the exact elements taken for scales -- with
    the counts of the fullest rank of its process group in `groups` (the one its row is
    sized for); None where they leave nothing for scales (an unquantized wire)."""
    peers = [item for item in groups if item.group_ranks == group.group_ranks] or [group]
    fullest = max(peers, key=lambda item: wire_bounds(item, 1 << 30)[0])
    exact_bytes = (fullest.exact_numel + fullest.padding_numel) * fullest.element_bytes
    overhead = group.bytes_per_step - fullest.quantized_numel - exact_bytes
    if fullest.quantized_numel == 0 or overhead <= 0:
        return None
    return SCALE_BYTES * fullest.quantized_numel / overhead


EXACT_SIDE_CHANNEL_BYTES = 4
"""[Note: received bytes per process group]: the most bytes one exact element may take on the
wire (sent as fp32; the fewest is the working dtype's). The name is older than the one name
"exact elements" and stays: it is part of the probe rule's constants digest (judge.py), which
a rename would change without a rule change."""
ROW_SLACK_BYTES = 48
"""[Note: received bytes per process group]: padding one source's row per chunk may carry --
each of its three parts (codes, scales, exact elements) aligned to 16 bytes."""


def received_rule(probe: Probe) -> bool:
    """Whether `probe` was recorded with received bytes ([Note: received bytes per process
    group]); an older record is judged by the bytes sent ([Note: group size from the
    wire])."""
    return bool(probe.wire) and all(
        group.received_bytes_per_step is not None for group in probe.wire
    )


def _peers(groups: list[WireGroup], group: WireGroup) -> list[WireGroup]:
    return [item for item in groups if item.group_ranks == group.group_ranks] or [group]


def source_row_bounds(
    source: WireGroup, peers: list[WireGroup], group_size: int, chunks: int
) -> tuple[int, int]:
    """[Note: received bytes per process group]: the fewest and the most bytes of what
    `source` sends its peers per step in `chunks` chunks."""
    quantized, exact = source.quantized_numel, source.exact_numel
    numel = quantized + exact + source.padding_numel
    chunks = max(1, chunks)
    fewest = quantized + SCALE_BYTES * -(-quantized // group_size) + exact * source.element_bytes
    exact_anywhere = sum(item.exact_numel + item.padding_numel for item in peers)
    most = (
        numel
        + chunks * (group_size - 1)
        + SCALE_BYTES * (-(-numel // group_size) + chunks - 1)
        + min(numel, exact_anywhere) * max(source.element_bytes, EXACT_SIDE_CHANNEL_BYTES)
        + chunks * ROW_SLACK_BYTES
    )
    return fewest, most


def received_bounds(groups: list[WireGroup], group: WireGroup, group_size: int) -> tuple[int, int]:
    """[Note: received bytes per process group]: the fewest and the most bytes `group`'s
    rank may receive from its peers per step, given every rank's entry in `groups`."""
    peers = _peers(groups, group)
    others = [item for item in peers if item.rank != group.rank]
    world = len(group.group_ranks)
    chunks = -(-(group.rows_per_step or 0) // max(1, world - 1))
    bounds = [source_row_bounds(item, peers, group_size, chunks) for item in peers]
    fewest = sum(source_row_bounds(item, peers, group_size, chunks)[0] for item in others)
    missing = max(0, world - 1 - len(others))  # a rank whose entry is absent: its least
    fewest += missing * min(low for low, _ in bounds)
    return fewest, (world - 1) * max(most for _, most in bounds)


def received_group_size(groups: list[WireGroup], group: WireGroup) -> float | None:
    """The group size `group`'s received bytes imply by ``1 + 4/G`` bytes per quantized
    element, every byte beyond the peers' codes and exact elements taken for scales; None
    where they leave nothing for scales (an unquantized wire)."""
    others = [item for item in _peers(groups, group) if item.rank != group.rank]
    quantized = sum(item.quantized_numel for item in others)
    exact_bytes = sum(
        (item.exact_numel + item.padding_numel) * item.element_bytes for item in others
    )
    overhead = (group.received_bytes_per_step or 0) - quantized - exact_bytes
    if quantized == 0 or overhead <= 0:
        return None
    return SCALE_BYTES * quantized / overhead
