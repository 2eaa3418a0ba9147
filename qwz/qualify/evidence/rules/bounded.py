"""``bounded[candidate]``: the PR's staging bound, judged from the wire and from memory.

Every weight-gather collective a candidate issues over a process group -- the largest output of
any one, over every step window, on every rank (qwz/integrations/probe.py) -- must fit the bound
of [Note: the staging bound] (staging.py) for the arm's own ``allgather_bucket_size``; the
storage the gather allocates and holds at once in its window, counted exactly on every device
([Note: staging memory, exactly], qualify/run/observers/staging_memory.py), over the
reference's on the same rank, must fit [Note: the gather's memory, exactly] (staging.py); and,
on CUDA, the candidate's whole peak over the reference's must fit [Note: staging in memory]. A
CPU arm's peak RSS is shown, never judged.

n/a where nothing was gathered (or the arm failed before a gather); one rank is inconclusive
(nothing is sent, so nothing was tested: [Note: one rank], in_effect.py); a probe with collectives
it could not attribute is inconclusive (the largest might be among them); a record written
before the largest output was recorded reads "not observed".
"""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence import staging
from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Arm, Check, Memory, Probe, Record, WireGroup

LARGEST_OUTPUT = "probes[].wire[].largest_output_bytes"
"""The rule's input that records of schema 4 and older lack."""
ONE_RANK = (
    "one rank: the weight gather is a local copy, so no collective was bounded; run with "
    "--world-size 2 or more"
)
MIB = 2**20


@rule("bounded", 2, inputs=(LARGEST_OUTPUT,))
def bounded_checks(record: Record) -> list[Check]:
    """``bounded[arm]`` for every candidate arm with a probe (module docstring)."""
    arms = {arm.name: arm for arm in record.arms}
    failures = {trajectory.arm: trajectory.failure for trajectory in record.trajectories}
    reference = next(arm.name for arm in record.arms if arm.role == "reference")
    return [
        _bounded(probe, arms[probe.arm], reference, record, failures.get(probe.arm))
        for probe in record.probes
        if arms[probe.arm].role == "candidate"
    ]


def _peers(probe: Probe, group: WireGroup) -> list[WireGroup]:
    return [item for item in probe.wire if item.group_ranks == group.group_ranks] or [group]


def group_bound(probe: Probe, group: WireGroup, arm: Arm) -> staging.StagingBound:
    """[Note: the staging bound] for `group`'s process group, from the counts of every rank's
    entry for it in `probe` (the most exact and padding elements of any one rank)."""
    exact = max(item.exact_numel + item.padding_numel for item in _peers(probe, group))
    return staging.collective_bound(
        bucket=int(arm.allgather_bucket_size or 0),
        world_size=len(group.group_ranks),
        group_size=int(arm.group_size or 0),
        element_bytes=group.element_bytes,
        rank_exact_numel=exact,
    )


def _unjudgeable(
    probe: Probe, arm: Arm, world_size: int, failure: Any, groups: list[WireGroup]
) -> Check | None:
    """The check where the wire cannot decide (module docstring); None where it can."""
    name = f"bounded[{arm.name}]"
    if world_size == 1:
        return check(name, "inconclusive", ONE_RANK)
    if probe.uncounted_calls:
        return check(
            name,
            "inconclusive",
            f"{probe.uncounted_calls} collective calls could not be attributed to a process "
            "group: the largest weight-gather collective may be among them",
            uncounted_calls=probe.uncounted_calls,
        )
    if any(group.largest_output_bytes is None for group in groups):
        return check(
            name,
            "n/a",
            f"not observed: the record lacks {LARGEST_OUTPUT}",
            not_observed=[LARGEST_OUTPUT],
        )
    if arm.allgather_bucket_size is None or arm.group_size is None:
        return check(name, "n/a", "not observed: the arm's allgather_bucket_size is not recorded")
    if not any(group.largest_output_bytes for group in groups):
        what = "any weight-gather collective over two or more ranks"
        if failure is not None:
            return check(name, "n/a", f"the arm failed before {what} was measured; see finite")
        return check(name, "n/a", f"nothing was gathered: not {what}")
    return None


def _bounded(probe: Probe, arm: Arm, reference: str, record: Record, failure: Any) -> Check:
    """One candidate's check: the wire against [Note: the staging bound] on every rank and
    process group, memory against [Note: staging in memory]."""
    groups = [group for group in probe.wire if len(group.group_ranks) > 1]
    unjudgeable = _unjudgeable(probe, arm, record.environment.world_size, failure, groups)
    if unjudgeable is not None:
        return unjudgeable
    bounds = [(group, group_bound(probe, group, arm)) for group in groups]
    over = [
        f"rank {group.rank} over ranks {group.group_ranks}: {group.largest_output_bytes:,} B > "
        f"{bound.bound_bytes:,} B"
        for group, bound in bounds
        if (group.largest_output_bytes or 0) > bound.bound_bytes
    ]
    worst, worst_bound = max(
        bounds, key=lambda item: (item[0].largest_output_bytes or 0) / item[1].bound_bytes
    )
    memory_text, memory_numbers, memory_over = _memory(probe, reference, record.memory, bounds)
    window_text, window_numbers, window_over = _window(probe, reference, record.memory, bounds)
    memory_text = f"{window_text}; {memory_text}"
    memory_numbers |= window_numbers
    memory_over = memory_over or window_over
    largest = worst.largest_output_bytes or 0
    how = (
        f"E = max(allgather_bucket_size {arm.allgather_bucket_size:,}, W x G "
        f"{len(worst.group_ranks) * (arm.group_size or 0):,}) = {worst_bound.chunk_elements:,} "
        f"elements x {worst.element_bytes} B, plus the exact-element and row allowance ([Note: "
        "the staging bound], qwz/qualify/evidence/staging.py)"
    )
    numbers = {
        "largest_output_bytes": largest,
        "bound_bytes": worst_bound.bound_bytes,
        "chunk_elements": worst_bound.chunk_elements,
        "calls_per_step": worst.calls_per_step,
        **memory_numbers,
    }
    if over or memory_over:
        wire = f"a weight-gather collective exceeds the staging bound: {'; '.join(over[:4])}"
        detail = wire if over else "every weight-gather collective within the staging bound"
        return check(f"bounded[{arm.name}]", "fail", f"{detail} ({how}); {memory_text}", **numbers)
    return check(
        f"bounded[{arm.name}]",
        "pass",
        f"every weight-gather collective within the staging bound: the largest "
        f"{largest:,} B (rank {worst.rank} over ranks {worst.group_ranks}, "
        f"{worst.calls_per_step} collectives in its last step) of {worst_bound.bound_bytes:,} B "
        f"({how}); {memory_text}",
        **numbers,
    )


def _allowance(probe: Probe, group: WireGroup, bound: staging.StagingBound) -> int:
    """[Note: staging in memory] for `group`'s process group, from every rank's counts."""
    peers = _peers(probe, group)
    return staging.memory_allowance_bytes(
        bound,
        exact_numel=sum(item.exact_numel + item.padding_numel for item in peers),
        gathered_numel=sum(
            item.quantized_numel + item.exact_numel + item.padding_numel for item in peers
        ),
    )


def _memory(
    probe: Probe, reference: str, memory: list[Memory], bounds: list[tuple[WireGroup, Any]]
) -> tuple[str, dict[str, Any], bool]:
    """[Note: staging in memory]: (the detail's memory part, its numbers, whether it fails),
    over every rank with a peak of this arm and of the `reference` arm of the same kind."""
    peaks = {(item.arm, item.rank): item for item in memory}
    rows = []
    for rank in sorted({group.rank for group, _ in bounds}):
        ours, theirs = peaks.get((probe.arm, rank)), peaks.get((reference, rank))
        if ours is None or theirs is None or ours.kind != theirs.kind:
            continue
        excess = ours.peak_allocated_bytes - theirs.peak_allocated_bytes
        allowance = sum(
            _allowance(probe, group, bound) for group, bound in bounds if group.rank == rank
        )
        rows.append((rank, ours.kind, excess, allowance))
    if not rows:
        return "memory: no peak of the reference on the same rank to compare with", {}, False
    rank, kind, excess, allowance = max(rows, key=lambda row: row[2] - row[3])
    numbers = {
        "memory_kind": kind,
        "memory_excess_bytes": excess,
        "memory_allowance_bytes": allowance,
    }
    said = f"{excess / MIB:+.2f} MiB over the reference's peak on rank {rank}"
    if kind not in staging.MEMORY_KINDS_JUDGED:
        return (
            f"memory: host peak RSS {said}: context only, never judged (RSS is page-granular "
            "and moved by the allocator; only CUDA's allocated bytes decide: [Note: staging in "
            "memory])",
            numbers,
            False,
        )
    over = excess > allowance
    verdict = "beyond" if over else "within"
    text = f"memory: {kind} {said}, {verdict} the allowance of {allowance / MIB:.2f} MiB"
    return text, numbers, over


def _window_allowance(probe: Probe, group: WireGroup, bound: staging.StagingBound) -> int:
    """[Note: the gather's memory, exactly] for `group`'s process group, every rank's counts."""
    peers = _peers(probe, group)
    return staging.window_allowance_bytes(
        bound,
        world_size=len(group.group_ranks),
        exact_numel=sum(item.exact_numel + item.padding_numel for item in peers),
    )


def _window(
    probe: Probe, reference: str, memory: list[Memory], bounds: list[tuple[WireGroup, Any]]
) -> tuple[str, dict[str, Any], bool]:
    """[Note: the gather's memory, exactly]: (the detail's part, its numbers, whether it fails),
    the rank whose window held most beyond its allowance; "not observed" where a rank's record
    lacks the figure (schema 5 and older)."""
    peaks = {(item.arm, item.rank): item for item in memory}
    rows = []
    for rank in sorted({group.rank for group, _ in bounds}):
        ours, theirs = peaks.get((probe.arm, rank)), peaks.get((reference, rank))
        if ours is None or theirs is None:
            continue
        if ours.staging_peak_bytes is None or theirs.staging_peak_bytes is None:
            return "gather memory: not observed (the record lacks it)", {}, False
        excess = ours.staging_peak_bytes - theirs.staging_peak_bytes
        allowance = sum(
            _window_allowance(probe, group, bound) for group, bound in bounds if group.rank == rank
        )
        rows.append((rank, excess, allowance, ours))
    if not rows:
        return "gather memory: no window of the reference on the same rank to compare", {}, False
    rank, excess, allowance, ours = max(rows, key=lambda row: row[1] / max(1, row[2]))
    numbers = {"staging_excess_bytes": excess, "staging_allowance_bytes": allowance}
    said = (
        f"gather memory: {excess:,} B of tensor storage allocated and held at once in a step's "
        f"window beyond the reference's on rank {rank}"
    )
    if excess <= allowance:
        return f"{said}, within the allowance of {allowance:,} B", numbers, False
    largest = "; ".join(f"{item.bytes:,} B at {item.where}" for item in ours.staging_largest)
    return (
        f"{said}, beyond the allowance of {allowance:,} B ([Note: the gather's memory, exactly], "
        f"qwz/qualify/evidence/staging.py); the largest live then: {largest or 'none listed'}",
        numbers,
        True,
    )
