"""Integer size arithmetic shared by the layout, the wire format and the kernels.

Pure functions on Python ints (or torch's symbolic ints under ``torch.compile``); nothing
here allocates. One helper per idea, so that padding to whole quantization groups is
written once.
"""

from __future__ import annotations


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer at least ``numerator / denominator`` (``denominator > 0``)."""
    return -(-numerator // denominator)


def round_up(numel: int, multiple: int) -> int:
    """`numel` padded to a whole number of `multiple` elements: the length of `numel`
    elements split into groups of `multiple`, the last group zero-padded."""
    return ceil_div(numel, multiple) * multiple
