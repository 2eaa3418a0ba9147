"""``update[arm]``: every sampled master update equals AdamW's on the arm's own gradient and
state ([Note: exact update check] and [Note: global norm check] in
qualify/run/observers/update.py, which observes it on the ranks); fp16: the steps skipped
against the overflows ([Note: overflow pattern] in overflow_pattern.py)."""

from __future__ import annotations

from qwz.qualify.evidence import optimizer
from qwz.qualify.evidence.rules import check, overflow_pattern, rule
from qwz.qualify.evidence.schema import Check


def _where(violation) -> str:
    index = f"[{violation.index}]" if violation.index >= 0 else ""
    return f"step {violation.step}, rank {violation.rank}, {violation.parameter}{index}"


def _skip_problems(skips: overflow_pattern.Skips | None) -> str:
    """fp16: the steps skipped or taken against the overflows ([Note: overflow pattern])."""
    if skips is None:
        return ""
    wrong = [
        f"rank {rank} did not step at step {step}, though no rank's gradient overflowed"
        for step, rank in skips.unwarranted
    ] + [
        f"rank {rank} stepped at step {step}, though a rank's fp16 gradient overflowed"
        for step, rank in skips.stepped_on_overflow
    ]
    return "; ".join(wrong[:4]) + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")


@rule("update", 2)
def update(updates, skips: overflow_pattern.Skips | None = None, config=None) -> Check:
    """[Note: exact update check] and [Note: global norm check] (qualify/run/observers/update.py);
    fp16: the skips against the overflows ([Note: overflow pattern]); n/a for an arm whose
    config's optimizer is not re-derived ([Note: the optimizer the update check re-derives],
    qualify/evidence/optimizer.py), unless its steps or its handed norm failed."""
    name = f"update[{updates.arm}]"
    wrong_skips = _skip_problems(skips)
    if wrong_skips:
        return check(name, "fail", f"fp16 skips: {wrong_skips}", violations=updates.violations)
    norm = (
        f"; the handed gradient's global norm matched min(norm, clip) on "
        f"{updates.norm_checked} steps (worst {updates.norm_max_ratio:.3g} of the bound)"
    )
    not_derived = optimizer.adamw_of(config or {})
    if isinstance(not_derived, str) and not (updates.missing_steps or updates.norm_violations):
        detail = f"{not_derived}: the update is not re-derived (AdamW only)"
        return check(name, "n/a", detail + (norm if updates.norm_checked else ""))
    if updates.checked == 0 and not (updates.missing_steps or updates.norm_violations):
        return check(name, "n/a", "no optimizer step was observed")
    if updates.violations or updates.missing_steps or updates.norm_violations:
        first = updates.first_violation
        where = f"first at {_where(first)}: {first.what}" if first else ""
        norms = (
            f"; the global norm of the gradient the optimizer was handed was wrong on "
            f"{updates.norm_violations} of {updates.norm_checked} steps"
            if updates.norm_violations
            else ""
        )
        return check(
            name,
            "fail",
            f"{updates.violations} of {updates.checked} sampled master updates differ "
            f"from AdamW's on the arm's own gradient and state{norms}; {where}",
            violations=updates.violations,
            norm_violations=updates.norm_violations,
            step=first.step if first else None,
        )
    return check(
        name,
        "pass",
        f"{updates.checked} sampled master updates"
        + (f" of {updates.optimizer}" if updates.optimizer else "")
        + " equal AdamW's on the arm's own "
        f"gradient and state within rounding (worst {updates.max_ratio:.3g} of "
        f"the bound){norm if updates.norm_checked else ''}; "
        + (
            f"one optimizer step per training step on every rank but on the "
            f"{len(skips.legitimate)} overflowed steps, which every rank skipped with its "
            "sampled masters unchanged"
            if skips is not None and skips.legitimate
            else "one optimizer step per training step on every rank"
        ),
        checked=updates.checked,
        max_ratio=updates.max_ratio,
        norm_checked=updates.norm_checked,
        norm_max_ratio=updates.norm_max_ratio,
    )
