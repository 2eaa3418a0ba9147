"""``overflow-pattern[arm]``, and fp16 dynamic loss scaling as the judge sees it: which steps were
skipped legitimately, and what the loss scale must have been at every step.

Pure functions of a record. The rules below are the judge's own statement of DeepSpeed's
documented ``fp16`` section; nothing here imports an engine's scaler (qwz/loss_scale.py is
the implementation under test, never the yardstick).

[Note: overflow pattern]
An fp16 arm multiplies its loss by a scale before backward; a step whose loss-scaled
gradient holds an Inf or NaN on any rank must be skipped on every rank, and the scale
moves by DeepSpeed's rules. The harness observes, per step ([Note: overflow observation],
qualify/run/observers/overflow.py), the scale the loss was actually multiplied by on each rank,
whether any rank's scaled gradient overflowed, and which ranks' optimizers stepped. From
those alone:

- ``finite``: a non-finite loss or gradient norm is allowed on an overflowed step that
  every rank skipped (the scaler's business); on any other step it fails.
- ``update``: a rank that did not step on a step without overflow, or stepped on one
  with overflow, fails; a skipped step must leave the sampled masters unchanged (the
  rank-side check) and counts as no optimizer step (Adam's step count, also rank-side).
- ``overflow-pattern``: the scale applied at every step equals what the rules give from
  the arm's configured ``fp16`` section and its own observed overflows, on every rank.
  Starting from ``2**initial_scale_power`` (a positive ``loss_scale`` fixes the scale
  instead), an overflow spends one unit of hysteresis or, with one unit left (or
  ``hysteresis`` 1), halves the scale, never below ``min_loss_scale``; after a clean step,
  when the clean steps since the last overflow before it are a positive multiple of
  ``loss_scale_window``, the scale doubles and the hysteresis refills
  (``consecutive_hysteresis``: every clean step refills it).
  A candidate is also compared with the reference. Until an arm's first optimizer step
  no gather has run, so every arm holds the reference's weights, sees its batches and
  applies its scale: up to the first step either arm took, the two must overflow at the
  same steps, or the candidate FAILs. After it the candidate's quantized weights give
  slightly different gradients, and an overflow decides on the largest scaled element
  against 65504: a correct candidate can overflow one step earlier or later than the
  reference where that element sits near the threshold. So a later difference is
  reported (the steps, in the detail and the numbers), not failed: each arm's skips are
  already held to its own gradients and the rules, and what a different skip costs in
  learning is what ``learning`` judges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Check, LossScaling, Record, Updates

SCALE_FACTOR = 2.0
"""DeepSpeed's dynamic scale doubles and halves by this factor."""
DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
"""DeepSpeed's documented defaults for the ``fp16`` keys a config leaves out."""


def expected_scales(section: dict[str, Any], overflowed: list[bool]) -> list[float]:
    """The scale DeepSpeed's rules ([Note: overflow pattern]) apply at each step, given the
    arm's ``fp16`` config `section` and whether each step overflowed. A step that overflows
    at ``min_loss_scale`` ends the list: no scale is allowed after it."""
    keys = DEFAULTS | section
    fixed = float(keys["loss_scale"])
    scale = fixed if fixed > 0 else SCALE_FACTOR ** int(keys["initial_scale_power"])
    window, hysteresis = int(keys["loss_scale_window"]), int(keys["hysteresis"])
    minimum, consecutive = float(keys["min_loss_scale"]), bool(keys["consecutive_hysteresis"])
    left, last_overflow, scales = hysteresis, -1, []
    for index, overflow in enumerate(overflowed):
        scales.append(scale)
        if fixed > 0:
            continue
        if overflow:
            if hysteresis == 1 or left == 1:
                if scale == minimum:
                    break
                scale = max(scale / SCALE_FACTOR, minimum)
            else:
                left -= 1
            last_overflow = index
            continue
        if consecutive:
            left = hysteresis
        clean = index - last_overflow - 1
        if clean > 0 and clean % window == 0:
            left = hysteresis
            scale *= SCALE_FACTOR
    return scales


@dataclass(frozen=True)
class Skips:
    """One fp16 arm's steps, as the evidence judges them (1-based step numbers)."""

    overflowed: frozenset[int]
    """Steps on which some rank's loss-scaled gradient held an Inf or NaN."""
    skipped_by_all: frozenset[int]
    """Steps on which no rank's optimizer stepped."""
    unwarranted: tuple[tuple[int, int], ...]
    """(step, rank): the rank did not step although no rank's gradient overflowed."""
    stepped_on_overflow: tuple[tuple[int, int], ...]
    """(step, rank): the rank stepped although a rank's gradient overflowed."""

    @property
    def legitimate(self) -> frozenset[int]:
        """Overflowed steps every rank skipped: a non-finite loss or norm is allowed there."""
        return self.overflowed & self.skipped_by_all


def skips(trace: LossScaling, updates: Updates, world_size: int) -> Skips:
    """[Note: overflow pattern]: the arm's skips against its observed overflows."""
    overflowed = frozenset(step for step, flag in enumerate(trace.overflowed, 1) if flag)
    skipped: dict[int, set[int]] = {}
    for step, rank in updates.skipped_steps:
        skipped.setdefault(step, set()).add(rank)
    steps = range(1, len(trace.overflowed) + 1)
    return Skips(
        overflowed=overflowed,
        skipped_by_all=frozenset(s for s in steps if len(skipped.get(s, ())) == world_size),
        unwarranted=tuple(
            (step, rank)
            for step in sorted(skipped)
            if step not in overflowed
            for rank in sorted(skipped[step])
        ),
        stepped_on_overflow=tuple(
            (step, rank)
            for step in sorted(overflowed)
            for rank in range(world_size)
            if rank not in skipped.get(step, set())
        ),
    )


def _scale_problem(trace: LossScaling, section: dict[str, Any]) -> str | None:
    """Why the observed scales break the rules (first step), or None."""
    expected = expected_scales(section, trace.overflowed)
    for rank, observed in enumerate(trace.scales):
        if len(observed) != len(trace.overflowed):
            return f"rank {rank} observed {len(observed)} scales for {len(trace.overflowed)} steps"
        for step, seen in enumerate(observed, 1):
            if seen is None:
                return f"step {step}, rank {rank}: no loss-scale gradient reached the loss"
            if step > len(expected):
                return f"step {step}: a step after an overflow at min_loss_scale"
            if seen != expected[step - 1]:
                return (
                    f"step {step}, rank {rank}: the loss was scaled by {seen:g}; the fp16 "
                    f"config and the overflows observed before it give {expected[step - 1]:g}"
                )
    return None


def _steps_text(steps: Any) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered)) if ordered else "none"


def overflow_pattern(
    trace: LossScaling,
    section: dict[str, Any],
    first_update_step: int | None,
    reference: tuple[LossScaling, int | None] | None,
) -> Check:
    """``overflow-pattern[arm]`` ([Note: overflow pattern]); `reference`: the reference's
    trace and first optimizer step, for a candidate (None for the reference itself)."""
    name = f"overflow-pattern[{trace.arm}]"
    if not trace.overflowed:
        return check(name, "n/a", "no fp16 step completed")
    problem = _scale_problem(trace, section)
    ours = {step for step, flag in enumerate(trace.overflowed, 1) if flag}
    scales = trace.scales[0] if trace.scales else []
    numbers: dict[str, Any] = {"overflowed": sorted(ours), "scales": scales}
    if problem is not None:
        return check(name, "fail", f"the loss scale does not follow the rules: {problem}")
    detail = (
        f"{len(ours)} of {len(trace.overflowed)} steps overflowed (steps {_steps_text(ours)}); "
        f"the loss scale on every rank followed DeepSpeed's rules from the fp16 config "
        f"(from {scales[0]:g} to {scales[-1]:g})"
    )
    if reference is None:
        return check(name, "pass", detail, **numbers)
    their_trace, their_first = reference
    theirs = {step for step, flag in enumerate(their_trace.overflowed, 1) if flag}
    common = min(len(trace.overflowed), len(their_trace.overflowed))
    different = {step for step in range(1, common + 1) if (step in ours) != (step in theirs)}
    before_gather = min(
        step for step in (first_update_step, their_first, common) if step is not None
    )
    early = {step for step in different if step <= before_gather}
    numbers |= {"differs_from_reference": sorted(different), "same_weights_until": before_gather}
    if early:
        return check(
            name,
            "fail",
            f"overflowed differently from the reference at step(s) {_steps_text(early)}, "
            f"before any gather (until step {before_gather} both arms hold the same weights "
            f"and batches); the reference overflowed at {_steps_text(theirs)}",
            **numbers,
        )
    context = (
        f"; differs from the reference at step(s) {_steps_text(different)} after the first "
        f"gather (context: the reference overflowed at {_steps_text(theirs)})"
        if different
        else "; the same steps as the reference"
    )
    return check(name, "pass", detail + context, **numbers)


def arm_skips(record: Record) -> dict[str, Skips]:
    """Every fp16 arm's skips against its overflows, which ``finite`` and ``update`` judge
    too."""
    updates = {item.arm: item for item in record.updates}
    world_size = record.environment.world_size
    return {
        trace.arm: skips(trace, updates[trace.arm], world_size)
        for trace in record.loss_scaling
        if trace.arm in updates
    }


@rule("overflow-pattern", 1)
def overflow_patterns(record: Record, reference: str | None) -> list[Check]:
    """``overflow-pattern[arm]`` for every fp16 arm."""
    traces = {trace.arm: trace for trace in record.loss_scaling}
    first = {item.arm: item.step for item in record.step_one}
    configs = {arm.name: arm.config.get("fp16", {}) for arm in record.arms}
    roles = {arm.name: arm.role for arm in record.arms}
    base = traces.get(reference or "")
    return [
        overflow_pattern(
            trace,
            configs[trace.arm],
            first.get(trace.arm),
            (base, first.get(reference)) if base and roles[trace.arm] == "candidate" else None,
        )
        for trace in record.loss_scaling
    ]
