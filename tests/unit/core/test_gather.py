"""collectives.gather at world size 1: the same code the multigpu suite runs with real ranks,
with the collectives skipped (STYLE.md, "world_size == 1 is the same code")."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import qwz
from qwz.collectives import Staging, gather
from qwz.layout import plan_gather

from ..strategies import tensors
from .single_rank import fewer_examples


def test_no_process_group():
    """Every single-rank test relies on running without one (world size 1)."""
    assert not (dist.is_available() and dist.is_initialized())


# --------------------------------------------------------------------------- #
# collectives.gather at world size 1
# --------------------------------------------------------------------------- #

WORKING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GatherCase(NamedTuple):
    local_shard: torch.Tensor
    """fp32 (shard_numel,), magnitudes within fp16's range."""
    dtype: torch.dtype
    group_size: int
    budgets: list[int]
    """Staging budgets in bytes: below one unit, one unit, random, unbounded."""


@st.composite
def gather_cases(draw) -> GatherCase:
    group_size = draw(st.one_of(st.sampled_from([8, 64]), st.integers(1, 32).map(lambda k: 8 * k)))
    num_groups = draw(st.integers(0, 24))
    local_shard = draw(tensors(num_groups * group_size, torch.float32, (-20, 15))).reshape(-1)
    largest = (num_groups + 1) * (group_size + 4) * 4
    budgets = [0, group_size, draw(st.integers(0, largest)), draw(st.integers(0, largest)), 2**40]
    return GatherCase(local_shard, draw(st.sampled_from(WORKING_DTYPES)), group_size, budgets)


def check_gather(
    case: GatherCase, *, quantize: bool, group_size: int | None, expected: torch.Tensor
):
    element_size = torch.finfo(case.dtype).bits // 8
    unit_numel = 1 if group_size is None else group_size
    shard_numel = case.local_shard.numel()
    # The smallest chunk: one unit (codes + scale, or elements) of this one rank.
    minimal = unit_numel + 4 if quantize else unit_numel * element_size
    for budget in case.budgets:
        plan = plan_gather(
            world_size=1,
            source_numel=shard_numel,
            quantize=quantize,
            group_size=group_size,
            element_size=element_size,
            bucket_bytes=budget,
        )
        # NaN everywhere first: an element the gather does not write fails torch.equal.
        full = torch.full((1, shard_numel), math.nan, dtype=case.dtype)
        stats = gather(plan, case.local_shard, full, rank=0, staging=Staging())
        assert torch.equal(full[0], expected), f"budget {budget} B, {len(plan.chunks)} chunks"
        assert stats.collectives == 0
        assert stats.bytes_sent == 0
        assert stats.peak_staging_bytes == plan.staging_bytes <= max(budget, minimal)


@fewer_examples(2)
@given(case=gather_cases(), exact_unit=st.booleans())
def test_unquantized_gather_is_a_cast_whatever_the_chunking(case, exact_unit):
    """The exact region chunks in units of 1 element, the quantized region with quantization
    off in units of a group; neither changes a value."""
    group_size = None if exact_unit else case.group_size
    expected = case.local_shard.to(case.dtype)
    check_gather(case, quantize=False, group_size=group_size, expected=expected)


@fewer_examples(2)
@given(case=gather_cases())
def test_quantized_gather_is_dequantize_of_quantize_whatever_the_chunking(case):
    q = qwz.quantize(case.local_shard, case.group_size)
    expected = qwz.dequantize(q, case.dtype)
    check_gather(case, quantize=True, group_size=case.group_size, expected=expected)


@pytest.mark.parametrize("bucket_bytes", [48, 2**20], ids=["four-chunks", "one-chunk"])
def test_the_check_before_the_first_write_runs_once_and_can_stop_every_write(bucket_bytes):
    """``before_first_write`` ([Note: host reads in a step], qwz/optimizer.py) runs once,
    after packing and before any decode writes the destination; when it raises, the
    destination is untouched."""
    source = torch.linspace(-3.0, 5.0, 64)
    plan = plan_gather(
        world_size=1,
        source_numel=64,
        quantize=True,
        group_size=8,
        element_size=2,
        bucket_bytes=bucket_bytes,
    )
    dest = torch.full((1, 64), math.nan, dtype=torch.bfloat16)
    untouched = []

    def check() -> None:
        untouched.append(bool(dest.isnan().all()))

    gather(plan, source, dest, rank=0, staging=Staging(), before_first_write=check)
    assert untouched == [True] and not dest.isnan().any()

    def refuse() -> None:
        raise FloatingPointError("refused")

    dest.fill_(math.nan)
    with pytest.raises(FloatingPointError, match="refused"):
        gather(plan, source, dest, rank=0, staging=Staging(), before_first_write=refuse)
    assert dest.isnan().all()
