"""Flat-buffer layout and gather plans (qwz/layout.py), at world size 1: [Note: padding rule],
[Note: staging bound], [Note: wire row]."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz.layout import build_layout, plan_gather, resolve_shard_alignment
from qwz.shards import slots_in_range

from .single_rank import named_shapes


def alignments() -> st.SearchStrategy[int]:
    """1 (an exact buffer) or a quantization group size (a positive multiple of 8)."""
    return st.one_of(st.just(1), st.integers(1, 64).map(lambda k: 8 * k))


# --------------------------------------------------------------------------- #
# layout.build_layout / FlatLayout: [Note: padding rule]
# --------------------------------------------------------------------------- #


class LayoutCase(NamedTuple):
    named_shapes: list[tuple[str, torch.Size]]
    world_size: int
    shard_alignment: int


@st.composite
def layout_cases(draw, *, min_dim: int = 0) -> LayoutCase:
    return LayoutCase(
        draw(named_shapes(min_dim=min_dim)), draw(st.integers(1, 8)), draw(alignments())
    )


@given(case=layout_cases())
def test_layout_pads_to_equal_aligned_shards(case):
    flat = build_layout(case.named_shapes, case.world_size, case.shard_alignment)
    numel = sum(shape.numel() for _, shape in case.named_shapes)
    assert flat.numel == numel
    assert flat.padded_numel >= numel
    assert flat.padded_numel == case.world_size * flat.shard_numel
    assert flat.shard_numel % case.shard_alignment == 0
    assert flat.padded_numel - numel < case.world_size * case.shard_alignment
    # The ranks' shards tile [0, padded_numel) in rank order.
    ranges = [flat.shard_range(rank) for rank in range(case.world_size)]
    assert [start for start, _ in ranges] == [0] + [end for _, end in ranges[:-1]]
    assert ranges[-1][1] == flat.padded_numel


@given(case=layout_cases())
def test_layout_slots_are_back_to_back_in_order(case):
    flat = build_layout(case.named_shapes, case.world_size, case.shard_alignment)
    assert [(slot.name, slot.shape) for slot in flat.slots] == case.named_shapes
    offset = 0
    for slot in flat.slots:
        assert slot.offset == offset
        assert slot.end == offset + slot.shape.numel()
        offset = slot.end
    assert flat.numel == offset


def brute_force_names_in_range(
    named_shapes: list[tuple[str, torch.Size]], start: int, end: int
) -> list[str]:
    """Label every element with its parameter's name and read the labels in [start, end)."""
    owners = [name for name, shape in named_shapes for _ in range(shape.numel())]
    seen = set(owners[max(start, 0) : max(end, 0)])
    return [name for name, _ in named_shapes if name in seen]


@st.composite
def ranges_in_layout(draw) -> tuple[LayoutCase, int, int]:
    """A layout of non-empty parameters and a non-empty [start, end) range, possibly reaching
    into the padding or past it (empty ranges: the test after the property)."""
    case = draw(layout_cases(min_dim=1))
    padded = build_layout(case.named_shapes, case.world_size, case.shard_alignment).padded_numel
    start = draw(st.integers(0, padded + 2))
    return case, start, draw(st.integers(start + 1, padded + 3))


def names_in_range(flat, start: int, end: int) -> list[str]:
    """The parameters of `flat` that overlap [start, end), as the seam of [Note: own shards]
    (qwz/shards.py) finds them."""
    ranges = [(slot.name, slot.offset, slot.numel) for slot in flat.slots]
    return [slot.name for slot in slots_in_range(ranges, start, end)]


@given(case_range=ranges_in_layout())
def test_names_in_range_matches_brute_force(case_range):
    case, start, end = case_range
    flat = build_layout(case.named_shapes, case.world_size, case.shard_alignment)
    assert names_in_range(flat, start, end) == brute_force_names_in_range(
        case.named_shapes, start, end
    )


@pytest.mark.parametrize("position", [0, 1, 2, 3, 5])
def test_names_in_range_of_an_empty_range_is_empty(position):
    """An empty range [i, i) holds no element, so it overlaps no parameter, even one that
    spans position i."""
    flat = build_layout([("a", torch.Size([3])), ("b", torch.Size([2]))], 1, 1)
    assert names_in_range(flat, position, position) == []


# --------------------------------------------------------------------------- #
# layout.plan_gather: [Note: staging bound], [Note: wire row]
# --------------------------------------------------------------------------- #


class GatherProblem(NamedTuple):
    world_size: int
    source_numel: int
    quantize: bool
    group_size: int | None
    element_size: int
    bucket_bytes: int
    exact_numel: int
    exact_runs: tuple[tuple[tuple[int, int], ...], ...] | None

    @property
    def unit_numel(self) -> int:
        return 1 if self.group_size is None else self.group_size

    def plan(self):
        return plan_gather(**self._asdict())


@st.composite
def gather_problems(draw) -> GatherProblem:
    """A main stream (quantized or not, possibly not a whole number of groups), an exact
    stream of its own (quota) or inside the main stream (runs), and a budget below one
    minimal chunk, around the whole gather, or anywhere."""
    world_size = draw(st.integers(1, 6))
    group_size = 8 * draw(st.integers(1, 16))
    quantize = draw(st.booleans())
    unit_numel = group_size if quantize else draw(st.sampled_from([1, group_size]))
    group_size = None if unit_numel == 1 else group_size
    element_size = draw(st.sampled_from([2, 4]))
    source_numel = draw(st.integers(0, 40)) * unit_numel - draw(st.integers(0, unit_numel - 1))
    source_numel = max(source_numel, 0)
    exact_numel, exact_runs = 0, None
    mode = draw(st.sampled_from(["none", "quota", "runs"]))
    if mode == "quota":
        exact_numel = draw(st.integers(1, 300))
    elif mode == "runs" and source_numel:
        owners = []
        for _ in range(world_size):
            cuts = sorted(set(draw(st.lists(st.integers(0, source_numel), max_size=8))))
            owners.append(tuple(zip(cuts[::2], cuts[1::2], strict=False)))
        exact_runs = tuple(owners)
    if source_numel == 0 and exact_numel == 0:
        exact_numel = 1
    whole = world_size * (source_numel * 2 + exact_numel * element_size + 64)
    bucket_bytes = draw(
        st.one_of(st.integers(0, 200), st.integers(whole // 4, 2 * whole), st.integers(0, 2**40))
    )
    return GatherProblem(
        world_size,
        source_numel,
        quantize,
        group_size,
        element_size,
        bucket_bytes,
        exact_numel,
        exact_runs,
    )


def _exact_elements(problem: GatherProblem) -> list[set[int]]:
    if problem.exact_runs is not None:
        return [{i for s, e in runs for i in range(s, e)} for runs in problem.exact_runs]
    return [set(range(problem.exact_numel)) for _ in range(problem.world_size)]


@given(problem=gather_problems())
def test_gather_plan_moves_every_element_once_in_rows_that_hold_it(problem):
    plan = problem.plan()
    position = 0
    for index, chunk in enumerate(plan.chunks):
        assert chunk.start == min(position, problem.source_numel)
        last = index == len(plan.chunks) - 1 or plan.chunks[index + 1].end == chunk.end
        if not last:  # whole units except at the end of the stream
            assert (chunk.end - chunk.start) % problem.unit_numel == 0
        position = chunk.end
        row = chunk.row
        if problem.quantize:
            assert row.num_groups * problem.group_size >= chunk.end - chunk.start
            if row.num_groups:  # rows that carry scales keep the next row's aligned
                assert row.row_bytes % 4 == 0 and row.row_bytes - row.payload_bytes < 4
        else:
            assert row.raw_numel == chunk.end - chunk.start and row.row_bytes == row.payload_bytes
        for owner in range(problem.world_size):
            own = [piece for piece in chunk.pieces if piece.owner == owner]
            offsets = [piece.row_offset for piece in own]
            assert offsets == sorted(offsets)
            assert sum(piece.numel for piece in own) <= row.exact_numel
            if problem.exact_runs is not None:  # travels with the chunk that covers it
                assert all(chunk.start <= p.source_offset < chunk.end for p in own)
    assert position == problem.source_numel
    seen: list[list[int]] = [[] for _ in range(problem.world_size)]
    for chunk in plan.chunks:
        for piece in chunk.pieces:
            assert piece.source_offset == piece.dest_offset
            seen[piece.owner] += range(piece.source_offset, piece.source_offset + piece.numel)
    expected = _exact_elements(problem)
    for owner in range(problem.world_size):
        assert sorted(seen[owner]) == sorted(expected[owner]), owner


@given(problem=gather_problems())
def test_staging_of_both_buffers_within_the_budget_or_one_minimal_chunk(problem):
    """[Note: staging bound] with two buffers: both together within the budget; when half
    of it cannot hold one minimal chunk, one buffer of exactly that chunk."""
    plan = problem.plan()
    world_size = problem.world_size
    assert plan.staging_bytes == plan.num_buffers * world_size * plan.row_bytes
    if plan.num_buffers == 2:
        assert plan.staging_bytes <= problem.bucket_bytes
    elif plan.staging_bytes > problem.bucket_bytes:
        # Over budget only with the smallest chunk: one unit per rank, plus one exact
        # element (quota) or the exact elements inside that unit (runs).
        unit_bytes = (
            problem.unit_numel + 4
            if problem.quantize
            else problem.unit_numel * problem.element_size
        )
        exact = problem.unit_numel if problem.exact_runs is not None else 1
        minimal = -(-(unit_bytes + exact * problem.element_size) // 4) * 4
        assert plan.row_bytes <= minimal
    assert plan.wire_bytes() == (
        0 if world_size == 1 else sum(chunk.row.row_bytes for chunk in plan.chunks)
    )


def test_staging_bound_is_caught_by_the_two_buffer_rule():
    """The budget that holds the whole gather once but not twice: two buffers of half."""
    problem = GatherProblem(2, 64 * 10, True, 64, 2, 2 * 10 * 68, 0, None)
    plan = problem.plan()
    assert plan.num_buffers == 2 and plan.staging_bytes <= problem.bucket_bytes
    assert len(plan.chunks) == 2


# --------------------------------------------------------------------------- #
# layout.resolve_shard_alignment: one layout for engines of different group sizes
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("requested", "rule"),
    [
        (0, "must be a positive integer"),
        (-64, "must be a positive integer"),
        (64.0, "must be a positive integer"),
        (True, "must be a positive integer"),
        ("8192", "must be a positive integer"),
        (96, "must be a positive multiple of the quantization group size 64"),
        (32, "must be a positive multiple of the quantization group size 64"),
    ],
)
def test_bad_shard_alignment_is_refused_naming_the_value_and_the_rule(requested, rule):
    with pytest.raises(ValueError) as raised:
        resolve_shard_alignment(requested, group_size=64, quantize=True)
    message = str(raised.value)
    assert message.startswith(f"shard_alignment: {requested!r} is invalid: "), message
    assert rule in message


def test_shard_alignment_defaults_to_the_group_size_and_keeps_a_multiple():
    assert resolve_shard_alignment(None, group_size=64, quantize=True) == 64
    assert resolve_shard_alignment(8192, group_size=64, quantize=True) == 8192
    # An unquantized buffer (the reference arm) holds no groups: any positive alignment.
    assert resolve_shard_alignment(96, group_size=64, quantize=False) == 96


@st.composite
def qualification_arms(draw) -> tuple[list[tuple[str, torch.Size]], int, list[int]]:
    """Shapes, a world size and the group sizes of a qualification's candidate arms."""
    sizes = draw(st.lists(st.integers(1, 1024).map(lambda k: 8 * k), min_size=1, max_size=3))
    return draw(named_shapes()), draw(st.integers(1, 8)), sizes


@given(case=qualification_arms())
def test_one_shard_alignment_gives_every_arm_the_same_layout(case):
    """With the lcm of the group sizes as alignment, the reference (unquantized, the default
    group size) and every candidate place every parameter at the same offset and give every
    rank the same shard range, and each candidate's shards are whole groups of its own."""
    shapes, world_size, group_sizes = case
    common = math.lcm(*group_sizes)
    arms = [(64, False)] + [(size, True) for size in group_sizes]
    layouts = [
        build_layout(
            shapes, world_size, resolve_shard_alignment(common, group_size=size, quantize=quantize)
        )
        for size, quantize in arms
    ]
    first = layouts[0]
    for flat in layouts[1:]:
        assert flat.slots == first.slots
        assert flat.padded_numel == first.padded_numel
        assert [flat.shard_range(r) for r in range(world_size)] == [
            first.shard_range(r) for r in range(world_size)
        ]
    for flat, (size, _) in zip(layouts[1:], arms[1:], strict=True):
        assert flat.shard_numel % size == 0
