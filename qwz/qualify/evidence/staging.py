"""The PR's staging bound, stated by the harness itself (``bounded``,
qualify/evidence/rules/bounded.py).

Like spec.py, whose wire constants it reads, this module imports nothing from the code it judges
([Note: the judge's independence]): the bound is written out here from the PR's text.

[Note: the staging bound]
#8511 says the quantized gather runs "in bounded chunks": "the bucket limit applies across all
data-parallel ranks, with a minimum of one quantization group per rank". Read with DeepSpeed's
meaning of ``allgather_bucket_size`` -- a budget counted in elements of the working dtype --
a chunk spans at most

    E = max(allgather_bucket_size, W * G)        elements over all W ranks of the group,

and the judge holds each weight-gather collective to the bytes such a chunk may take. The
collective's *output* is what the probe measures (qwz/integrations/probe.py: a gather's output
tensor holds every rank's row; a broadcast's, one row), so the bound is on the bytes of one
collective's output:

    bound = E * b                                    the chunk in the working dtype (b bytes)
          + W * min(ceil(E / W), X) * max(b, EXACT_VALUE_BYTES)
          + W * ROW_PADDING(G)

and every term is a freedom of [Note: the contract and its freedoms] (spec.py), derived, not fitted:

- *Codes and scales*: a chunk's positions -- ``ceil(E / W)`` at most per rank, every rank
  sending its share -- cost ``1 + 4/G`` bytes each (an int8 code, a share of an fp32 scale),
  at most ``b`` for every working dtype the harness runs (b = 2 or 4, G >= 8): within ``E * b``,
  a code for every position (exact ones too) included.
- *Exact elements* (parameters of at most 65,536 elements, and the partition's padding, which a
  PR may send exactly) may travel beside the code of their position (the PR's own patch sends a
  zero code and the value) and as fp32 rather than the working dtype (a freedom ``probe``
  allows): ``max(b, 4)`` bytes each on top. An all-gather's rows have one size, so every row
  carries as many exact values as the rank with the most in the chunk: at most
  ``min(ceil(E / W), X)`` per row, ``X`` the most exact and padding elements any one rank of the
  group holds (the record's wire counts).
- *A row* (one rank's part of the collective) may pad its codes to whole groups (``G - 1``
  bytes), carry one more scale than ``n/G`` for a partial group (4 bytes) and align each of its
  three parts -- codes, scales, exact values -- to 16 bytes (48): ``ROW_PADDING = G + 51``.

Double buffering: two chunks in flight are two collectives, each held to the bound on its own
-- the bound is per collective, never on their sum -- and count twice toward memory (below).

[Note: staging in memory]
The bound on the wire is exact (the probe counts every collective's output); memory is the
second view. The candidate's peak over the reference's on the same rank -- the only difference
between the arms being the gather, the reference's gather writing in place -- may hold, per
process group it gathers over (:func:`memory_allowance_bytes`):

- ``IN_FLIGHT_COLLECTIVES`` (2: double buffering) collectives, each its output and this rank's
  input, each at most the bound: ``2 * 2 * bound``;
- the encode and the decode of each of them in fp32 (the master or the bf16 partition cast up,
  the scaled codes before their cast down): ``WORKSPACE_FP32_COPIES`` copies of its ``E``
  elements, ``2 * 4 * 4 * E`` bytes;
- what a PR keeps to find its exact elements: an int64 index per exact or padding element of
  every rank of the group (``8 * X_all``) and a one-byte mask over its gathered buffer
  (``W * P``).

What it decides: a gather holding more than a few chunks' staging at once -- every chunk's
fp32 decode kept, the partition in fp32 several times over. One collective for a whole partition
is the wire's to fail (on the chunked arm, whose bucket makes a collective a quarter of the
partition's encoded bytes, [Note: the chunked arm], such a collective fits the in-flight term);
so is a PR that issues every chunk at once on async handles within it (their staging together is
the partition's encoded bytes, the in-flight term again). Only exact memory decides: CUDA's
allocated bytes. A CPU arm's memory is the process's peak RSS, page-granular and moved by the
allocator's caching and the harness's own state by megabytes between two runs of the same code
(the README's matrix section: up to a tenth over a long cell), more than this allowance on a
small workload: there memory is shown as context, never a verdict.
"""

from __future__ import annotations

from typing import NamedTuple

from qwz.qualify.evidence.spec import SCALE_BYTES

EXACT_VALUE_BYTES = 4
"""The most bytes an exact element's value may take: fp32 (the least: the working dtype's)."""
ROW_ALIGNMENT_BYTES = 48
"""A row's three parts (codes, scales, exact values), each aligned to 16 bytes."""
IN_FLIGHT_COLLECTIVES = 2
"""Double buffering: chunk k's collective runs while chunk k + 1 is packed."""
WORKSPACE_FP32_COPIES = 4
"""fp32 copies of a collective's elements its encode and decode may hold at once."""
INDEX_BYTES = 8
"""An int64 position per exact element, kept to find it in every chunk."""
MASK_BYTES = 1
"""A bool per position of the gathered buffer (which elements travel exactly)."""
MEMORY_KINDS_JUDGED = ("cuda",)
"""Memory kinds exact enough to decide ([Note: staging in memory]); others are context."""


# [Note: the gather's memory, exactly]
# The window's own allocations are counted exactly on every device
# (qwz/qualify/run/observers/staging_memory.py, [Note: staging memory, exactly]): the storage the
# subject allocates between its masters' update and the next use of the weights and holds at
# once, the optimizer's step and the harness's work left out, the reference arm's figure taken
# off. Per process group it gathers over, a correct gather may hold:
#
# - IN_FLIGHT_COLLECTIVES chunks' collectives (double buffering): each its output, at most the
#   bound, and this rank's row of it as the input, ``2 * (bound + ceil(bound / W))``;
# - the encode and decode of one chunk in fp32 (the input cast up, the scaled values, the
#   rounded codes before their cast down; all W sources' decode at once):
#   WORKSPACE_FP32_COPIES copies of its E elements, ``4 * 4 * E`` bytes;
# - an int64 position per exact or padding element of every rank of the group, to find them.
#
# Unlike [Note: staging in memory] it allows no mask over the whole gathered buffer: one
# allocated in the window is a buffer the size of the partition, which is what the bound
# forbids. What it decides: a receive buffer for the whole partition sliced per call, the whole
# partition quantized before the first call, every chunk's buffers kept until the end -- each
# the partition's size, which exceeds the allowance wherever a partition spans a few dozen
# chunks (a small bucket, or the chunked arm: [Note: the chunked arm]).


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} is invalid: must be a positive integer")
    return value


def chunk_elements(bucket: int, world_size: int, group_size: int) -> int:
    """``E = max(allgather_bucket_size, W * G)``: the most elements one chunk spans over all
    ranks of a group of `world_size` ([Note: the staging bound])."""
    _positive("allgather_bucket_size", bucket)
    return max(bucket, _positive("world_size", world_size) * _positive("group_size", group_size))


def row_padding_bytes(group_size: int) -> int:
    """Bytes one rank's row may add beyond its elements' share: codes padded to whole groups,
    one more scale for a partial group, three parts aligned ([Note: the staging bound])."""
    return _positive("group_size", group_size) - 1 + SCALE_BYTES + ROW_ALIGNMENT_BYTES


def exact_value_bytes(element_bytes: int) -> int:
    """Bytes an exact element's value may take beside its position's code: fp32 at most."""
    return max(_positive("element_bytes", element_bytes), EXACT_VALUE_BYTES)


class StagingBound(NamedTuple):
    """One process group's bound, and the numbers it is made of."""

    chunk_elements: int
    """E: the most elements one chunk spans over all ranks."""
    bound_bytes: int
    """The most bytes one weight-gather collective's output may hold."""


def collective_bound(
    *, bucket: int, world_size: int, group_size: int, element_bytes: int, rank_exact_numel: int
) -> StagingBound:
    """[Note: the staging bound] for a gather over `world_size` ranks of `element_bytes`-byte
    working elements in groups of `group_size`, none of whose ranks holds more than
    `rank_exact_numel` exact and padding elements."""
    if (
        isinstance(rank_exact_numel, bool)
        or not isinstance(rank_exact_numel, int)
        or rank_exact_numel < 0
    ):
        raise ValueError(
            f"rank_exact_numel: {rank_exact_numel!r} is invalid: must be an integer >= 0"
        )
    elements = chunk_elements(bucket, world_size, group_size)
    row_exact = min(-(-elements // world_size), rank_exact_numel)
    bound = (
        elements * element_bytes
        + world_size * row_exact * exact_value_bytes(element_bytes)
        + world_size * row_padding_bytes(group_size)
    )
    return StagingBound(elements, bound)


def window_allowance_bytes(bound: StagingBound, *, world_size: int, exact_numel: int) -> int:
    """[Note: the gather's memory, exactly]: the most tensor storage one process group's gather
    may allocate and hold at once in its window, beyond what the reference arm's does, given its
    `bound`, the ranks of the group and the `exact_numel` exact and padding elements of all of
    them."""
    row = -(-bound.bound_bytes // _positive("world_size", world_size))
    in_flight = IN_FLIGHT_COLLECTIVES * (bound.bound_bytes + row)
    workspace = WORKSPACE_FP32_COPIES * 4 * bound.chunk_elements
    return in_flight + workspace + INDEX_BYTES * exact_numel


def memory_allowance_bytes(bound: StagingBound, *, exact_numel: int, gathered_numel: int) -> int:
    """[Note: staging in memory]: the most one process group's gather may add to a rank's peak,
    given its `bound`, the `exact_numel` exact and padding elements of all its ranks and the
    `gathered_numel` positions of its gathered buffer (W times a rank's partition)."""
    in_flight = IN_FLIGHT_COLLECTIVES * 2 * bound.bound_bytes
    workspace = IN_FLIGHT_COLLECTIVES * WORKSPACE_FP32_COPIES * 4 * bound.chunk_elements
    bookkeeping = INDEX_BYTES * exact_numel + MASK_BYTES * gathered_numel
    return in_flight + workspace + bookkeeping
