"""Number and table formats shared by the report, ``compare`` and the other summaries.

Speed-ups with three decimals (``1.037x [1.036, 1.039]``), times and losses with four
significant digits, memory in MiB or GiB, hashes shortened to 12 hex digits; markdown tables
whose cells escape ``|`` and newlines.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from qwz.qualify.evidence.schema import Arm, Record

SHORT_HASH_CHARS = 12
MIB = 1024**2
GIB = 1024**3


def format_sig(value: float, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits, positional (no exponent) unless tiny."""
    if not math.isfinite(value):
        return str(value)
    if value != 0.0 and abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    text = np.format_float_positional(
        value, precision=digits, unique=False, fractional=False, trim="k"
    )
    return text.rstrip(".")


def format_speedup(value: float) -> str:
    return f"{value:.3f}x"


def format_interval(low: float, high: float) -> str:
    return f"[{low:.3f}, {high:.3f}]"


def format_p(value: float) -> str:
    return f"{value:.2g}" if value >= 1e-4 else f"{value:.1e}"


def format_bytes(count: int | float) -> str:
    if abs(count) >= GIB:
        return f"{count / GIB:.2f} GiB"
    if abs(count) >= MIB:
        return f"{count / MIB:.1f} MiB"
    return f"{count:,.0f} B"


def is_finite(value: float | None) -> bool:
    """A number that is neither None, NaN nor infinite."""
    return value is not None and math.isfinite(value)


def short_hash(value: str | None) -> str:
    return "—" if value is None else value[:SHORT_HASH_CHARS]


def reference_arm(record: Record) -> Arm | None:
    """The arm that gathers unquantized (DESIGN.md: the reference of every comparison)."""
    return next((arm for arm in record.arms if not arm.quantized), None)


def cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return [*lines, ""]


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def devices(names: Sequence[str]) -> str:
    return ", ".join(f"{count} × {name}" for name, count in Counter(names).items()) or "—"


def group_size_text(size: int | None) -> str:
    return "off" if size is None else str(size)
