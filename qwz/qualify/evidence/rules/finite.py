"""``finite[arm]``: every arm ran to the end with finite numbers (fp16: but on the steps its
overflows legitimately skipped, [Note: overflow pattern] in overflow_pattern.py)."""

from __future__ import annotations

from qwz.qualify.evidence.rules import check, overflow_pattern, rule
from qwz.qualify.evidence.schema import Check


@rule("finite", 1)
def finite(trajectory, skips: overflow_pattern.Skips | None = None) -> Check:
    """Every arm ran to the end with finite numbers (fp16: except on legitimately skipped
    steps, [Note: overflow pattern])."""
    failure, name = trajectory.failure, f"finite[{trajectory.arm}]"
    allowed = skips.legitimate if skips is not None else frozenset()
    numbers = [
        value
        for series in (trajectory.losses, trajectory.grad_norms)
        for step, value in enumerate(series, 1)
        if step not in allowed
    ]
    if failure is not None and failure.kind == "not-run":
        return check(name, "n/a", failure.message)
    if failure is not None:
        params = f" (non-finite: {', '.join(failure.parameters)})" if failure.parameters else ""
        return check(
            name,
            "fail",
            f"{failure.kind} at step {failure.step} on rank {failure.rank}: "
            f"{failure.message}{params}",
            step=failure.step,
            rank=failure.rank,
        )
    if len(trajectory.losses) != trajectory.steps_planned or None in numbers:
        return check(
            name,
            "fail",
            f"{len(trajectory.losses)} of {trajectory.steps_planned} steps recorded, "
            f"{sum(value is None for value in numbers)} non-finite values",
        )
    skipped = (
        f" but on {len(allowed)} overflow-skipped steps (the loss scaler's business)"
        if allowed
        else ""
    )
    return check(
        name,
        "pass",
        f"{trajectory.steps_planned} steps, every loss and gradient norm finite{skipped}",
        steps=trajectory.steps_planned,
        overflow_skipped=len(allowed),
    )
