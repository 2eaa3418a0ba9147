"""Helpers shared by the single-rank unit tests (no process group: world size 1)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st


def fewer_examples(divisor: int) -> settings:
    """The loaded profile's example count divided by `divisor` (at least 5), for properties
    whose examples cost milliseconds each (an engine run, a gather of thousands of
    elements), so the file stays within a few seconds in CI and nightly still runs more."""
    return settings(max_examples=max(5, settings().max_examples // divisor))


ENGINE_EXAMPLES = fewer_examples(4)


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_subnormal=False)


@st.composite
def named_shapes(draw, *, min_dim: int = 0, min_count: int = 0) -> list[tuple[str, torch.Size]]:
    """Up to 6 uniquely named shapes of 0 to 3 dimensions (a 0-dim shape has one element)."""
    count = draw(st.integers(min_count, 6))
    return [
        (f"p{index}", torch.Size(draw(st.lists(st.integers(min_dim, 12), max_size=3))))
        for index in range(count)
    ]
