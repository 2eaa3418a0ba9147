"""The PR's staging bound, stated by the harness itself (``bounded``, qualify/evidence/bounded.py).

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

    bound = E * b                                 the chunk in the working dtype (b bytes)
          + min(E, X) * (CODE_BYTES + max(b, EXACT_VALUE_BYTES) - b)
          + W * ROW_PADDING(G)

and every term is a freedom of [Note: the contract and its freedoms] (spec.py), derived, not fitted:

- *Quantized elements* cost ``1 + 4/G`` bytes each (an int8 code and a share of an fp32 scale),
  at most ``b`` for every working dtype the harness runs (b = 2 or 4, G >= 8): within ``E * b``.
- *Exact elements* (parameters of at most 65,536 elements, and the partition's padding, which
  a PR may send exactly too) may travel beside a code for their position (the PR's own patch
  sends a zero code and the value) and as fp32 rather than the working dtype (a freedom
  ``probe`` allows): at most ``1 + max(b, 4)`` bytes, ``1 + max(b, 4) - b`` beyond their share
  of ``E * b``. A chunk holds at most ``min(E, X)`` of them, ``X`` the exact and padding
  elements of all the group's ranks (the record's wire counts).
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
  every rank (``8 * X``) and a one-byte mask over the group's gathered buffer (``W * P``).

A gather whose staging grows with the partition rather than the bucket -- one collective for a
whole partition, decoded in fp32 -- exceeds it once the partition holds a few buckets; a PR
that issues every chunk at once on async handles stays within it on the harness's workloads
(its outputs together are about the partition's quantized bytes). Only exact memory decides:
CUDA's allocated bytes. A CPU arm's memory is the process's peak RSS, page-granular and moved
by the allocator's caching and the harness's own state between two runs of the same code (the
README's matrix section: up to a tenth over a long cell), far more than this allowance on a
small workload: there memory is shown as context, never a verdict.
"""

from __future__ import annotations

from typing import NamedTuple

from qwz.qualify.evidence.spec import CODE_BYTES, SCALE_BYTES

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


def exact_extra_bytes(element_bytes: int) -> int:
    """Bytes an exact element may take beyond its working-dtype share: a code beside its value,
    and the value in fp32."""
    _positive("element_bytes", element_bytes)
    return CODE_BYTES + max(element_bytes, EXACT_VALUE_BYTES) - element_bytes


class StagingBound(NamedTuple):
    """One process group's bound, and the numbers it is made of."""

    chunk_elements: int
    """E: the most elements one chunk spans over all ranks."""
    bound_bytes: int
    """The most bytes one weight-gather collective's output may hold."""


def collective_bound(
    *, bucket: int, world_size: int, group_size: int, element_bytes: int, exact_numel: int
) -> StagingBound:
    """[Note: the staging bound] for a gather over `world_size` ranks of `element_bytes`-byte
    working elements in groups of `group_size`, whose ranks hold `exact_numel` exact and
    padding elements together."""
    if isinstance(exact_numel, bool) or not isinstance(exact_numel, int) or exact_numel < 0:
        raise ValueError(f"exact_numel: {exact_numel!r} is invalid: must be an integer >= 0")
    elements = chunk_elements(bucket, world_size, group_size)
    bound = (
        elements * element_bytes
        + min(elements, exact_numel) * exact_extra_bytes(element_bytes)
        + world_size * row_padding_bytes(group_size)
    )
    return StagingBound(elements, bound)


def memory_allowance_bytes(bound: StagingBound, *, exact_numel: int, gathered_numel: int) -> int:
    """[Note: staging in memory]: the most one process group's gather may add to a rank's peak,
    given its `bound`, the `exact_numel` exact and padding elements of all its ranks and the
    `gathered_numel` positions of its gathered buffer (W times a rank's partition)."""
    in_flight = IN_FLIGHT_COLLECTIVES * 2 * bound.bound_bytes
    workspace = IN_FLIGHT_COLLECTIVES * WORKSPACE_FP32_COPIES * 4 * bound.chunk_elements
    bookkeeping = INDEX_BYTES * exact_numel + MASK_BYTES * gathered_numel
    return in_flight + workspace + bookkeeping
