"""Self-tests: fused kernels must write the eager kernels' bytes, checked on rows at the edges
of the wire format before any fused kernel serves."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from qwz.kernels.fused import EAGER_KERNELS, QuantKernels, torch_kernels
from qwz.quant import SUPPORTED_DTYPES, WireRow, row_codes, row_scales
from qwz.sizes import ceil_div

RAMP_ROWS = ((8, 4, 5), (64, 3, 0))
"""(group size, groups, elements short of whole groups) of ramp rows :func:`compare_with_eager`
encodes besides the row of extremes (the only row of :func:`self_test_on`)."""
NATIVE_SELF_TEST_ROWS = ((64, 17, 5), (1000, 17, 5), (8, 3, 5), (100, 2, 150))
"""Rows taking every path of the native kernels: blocks of 16 groups at the G=64 fast path,
a block of groups too large to share L1 (encoded one at a time), partial blocks, any other
group size, and a group wholly past the source's end."""
EXTREMES_GROUP_SIZE = 8


def ramp_values(group_size: int, numel: int) -> torch.Tensor:
    """A ramp; with two groups or more, a zero first group and a second that holds 127 (scale
    1) and the ties 2.5 and -3.5 (codes 2 and -4: half to even)."""
    values = torch.linspace(-3.0, 5.0, numel)
    if numel >= 2 * group_size and group_size >= 3:
        values[:group_size] = 0.0
        values[group_size : group_size + 3] = torch.tensor([127.0, 2.5, -3.5])
    return values


def extreme_values() -> torch.Tensor:
    """fp32 groups of :data:`EXTREMES_GROUP_SIZE` at the edges of the scale formula: zeros,
    negative zeros, subnormals only (the 2**-126 floor), the largest finite values (the
    overflow step), mixed signs and magnitudes, a group just above the floor, and ties of
    the code rounding. Finite only: NaN payloads differ between CPU and CUDA arithmetic."""
    tiny, largest = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    smallest = 2.0**-149
    groups = [
        [0.0] * 8,
        [-0.0] * 8,
        [smallest, -smallest, tiny / 2, -tiny / 4, 3 * smallest, 0.0, -0.0, tiny * (1 - 2**-23)],
        [largest, -largest, largest / 3, -1.0, 0.0, largest / 127, -largest / 254, 1e30],
        [largest, largest, largest, largest, -largest, -largest, largest, -largest],
        [1.0, -1.0, 0.5, -0.25, 1e-30, -1e30, 3.0e-39, 127.0],
        [tiny * 127, tiny * 200, -tiny, tiny * 63.5, 0.0, -tiny * 127, tiny, tiny * 1.5],
        [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 125.5],
        [1e-40, -1e-38, 2e-38, -5e-39, 1e-45, 0.0, 7e-39, -3e-38],
        [3.0, -7.0, 1.0e-7, 65504.0, -65520.0, 3.4e38, -1.2e-38, 9.9e37],
    ]
    return torch.tensor(groups, dtype=torch.float32).reshape(-1)


def _self_test_cases(rows):
    """(values, group size, groups) of every self-test row: a ramp per entry of `rows`, then
    one row of :func:`extreme_values` followed by a ramp with ties and a partial last group
    (one shape, so a self-test adds one compile per kernel)."""
    for group_size, num_groups, short in rows:
        yield ramp_values(group_size, num_groups * group_size - short), group_size, num_groups
    values = torch.cat([extreme_values(), ramp_values(EXTREMES_GROUP_SIZE, 27)])
    yield values, EXTREMES_GROUP_SIZE, ceil_div(values.numel(), EXTREMES_GROUP_SIZE)


def _written(kernels: QuantKernels, values, group_size, num_groups, dtype, device):
    """The wire row `kernels` encode `values` into and what they decode it to, both on
    `device`, as CPU tensors."""
    layout = WireRow(num_groups, group_size, exact_numel=0, element_size=4)
    row = torch.zeros(1, layout.row_bytes, dtype=torch.uint8, device=device)
    kernels.encode(values.to(device), row_scales(row, layout)[0], row_codes(row, layout)[0])
    decoded = torch.empty(1, values.numel(), dtype=dtype, device=device)
    kernels.decode(row_scales(row, layout), row_codes(row, layout), decoded)
    return row.cpu(), decoded.cpu()


class KernelMismatch(NamedTuple):
    """One self-test row where two kernels wrote different bytes."""

    against: str
    """The reference: ``"eager on cpu"`` or ``"eager on <device>"``."""
    group_size: int
    num_groups: int
    dtype: torch.dtype
    row_bytes_differ: int
    """Bytes of the wire row that differ."""
    decoded_differ: int
    """Decoded elements whose bytes differ."""


class KernelComparison(NamedTuple):
    """:func:`compare_with_eager`'s report: the rows checked and every mismatch."""

    device: str
    dtype: torch.dtype
    kernels: str
    rows_checked: int
    mismatches: tuple[KernelMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def compare_with_eager(
    device: torch.device | str,
    dtype: torch.dtype,
    kernels: QuantKernels | None = None,
    rows: tuple[tuple[int, int, int], ...] = RAMP_ROWS + NATIVE_SELF_TEST_ROWS,
) -> KernelComparison:
    """Bytes of `kernels` (default: fresh ``torch.compile`` kernels, native ones off) on
    `device`, encoding fp32 rows and decoding into `dtype`, against the eager kernels on the
    CPU (the bytes every rank must agree on) and, on another device, the eager kernels
    there (eager CUDA must match the CPU too). Rows: ramps of `rows` and
    :func:`extreme_values`. Raises what the kernels raise (a failed compile)."""
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is invalid: must be one of {SUPPORTED_DTYPES}")
    kernels = torch_kernels() if kernels is None else kernels
    references = [("eager on cpu", torch.device("cpu"))]
    if device.type != "cpu":
        references.append((f"eager on {device}", device))
    mismatches, checked = [], 0
    for values, group_size, num_groups in _self_test_cases(rows):
        checked += 1
        row, decoded = _written(kernels, values, group_size, num_groups, dtype, device)
        for name, where in references:
            expected_row, expected = _written(
                EAGER_KERNELS, values, group_size, num_groups, dtype, where
            )
            row_differ = int((row != expected_row).sum())
            decoded_differ = int((decoded.view(torch.uint8) != expected.view(torch.uint8)).sum())
            if row_differ or decoded_differ:
                mismatches.append(
                    KernelMismatch(name, group_size, num_groups, dtype, row_differ, decoded_differ)
                )
    return KernelComparison(str(device), dtype, kernels.name, checked, tuple(mismatches))


def require_eager_bytes(report: KernelComparison) -> None:
    if not report.ok:
        first = report.mismatches[0]
        raise RuntimeError(
            f"{report.kernels} kernels on {report.device} do not reproduce the eager kernels' "
            f"bytes ({first.against}: G={first.group_size}, {first.num_groups} groups, "
            f"{first.dtype}; {len(report.mismatches)} of {report.rows_checked} rows differ)"
        )


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@functools.cache
def self_test_on(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch.compile`` cannot serve wire kernels on `device` decoding into `dtype`
    (None when it can): fresh compiled kernels encode fp32 self-test rows there and decode
    them into `dtype`, and must write the CPU eager kernels' bytes (on CPU this also needs a
    C++ compiler). Once per device and dtype, before the first compiled call there."""
    try:
        require_eager_bytes(compare_with_eager(device, dtype, rows=()))
    except Exception as error:  # any failure means: eager there, and say why
        return first_line(error)
    return None
