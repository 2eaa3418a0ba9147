"""The plots a reviewer judges by: held-out loss against the margin, and times per step.

Drawn on a matplotlib ``Figure`` that ``report.write_plots`` creates (Agg canvas, no
pyplot). Every number drawn is in the record.

* ``held_out.png``: the held-out loss of every arm at each evaluation step (the
  ``learning`` checks judge these, [Note: learning margin], qualify/evidence/checks.py), and below
  it each arm's difference from the reference with the margin a candidate must stay
  under; the calibration arm, whose gap sets the margin, is drawn as the arms are.
* ``step_times.png``: per candidate, the median ms/step of each block for the reference
  and the candidate, and the median ms of their weight gathers in those steps ([Note:
  gather phase timing], qualify/run/gather_timing.py) where they were measured.
"""

from __future__ import annotations

import math

from qwz.qualify.evidence.schema import Record


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _draw_horizon(gap_axes, record: Record) -> None:
    """The long rule ([Note: non-inferiority over the horizon]): the window, and the margin
    each candidate's mean gap over it (upper bound) must stay under."""
    for check in record.checks:
        numbers = check.numbers
        if not check.name.startswith("learning[") or numbers.get("upper") is None:
            continue
        start, end = numbers["window"]
        gap_axes.axvspan(start, end, color="C2", alpha=0.08)
        gap_axes.hlines(numbers["margin"], start, end, color="C3", linewidth=1.2)
        gap_axes.hlines(numbers["upper"], start, end, color="C1", linewidth=1.0, linestyle="--")
    gap_axes.plot([], [], color="C3", label="margin over the window")
    gap_axes.plot([], [], color="C1", linestyle="--", label="upper bound of the mean gap")


def draw_held_out(figure, record: Record) -> None:
    from qwz.qualify.evidence.checks import learning_margin

    reference = next((arm.name for arm in record.arms if arm.role == "reference"), None)
    roles = {arm.name: arm.role for arm in record.arms}
    series = {t.arm: {h.step: h.loss for h in t.held_out} for t in record.trajectories}
    steps = record.learning.eval_steps
    loss_axes, gap_axes = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for index, (arm, values) in enumerate(series.items()):
        is_reference = arm == reference
        style = {
            "color": "black" if is_reference else f"C{index}",
            "linewidth": 2.4 if is_reference else 1.4,
            "linestyle": "-" if is_reference else ":" if roles[arm] == "calibration" else "--",
            "marker": "o",
            "markersize": 3,
            "label": f"{arm} ({roles[arm]})",
        }
        loss_axes.plot(steps, [_nan(values.get(step)) for step in steps], **style)
        if reference is not None and not is_reference:
            base = series[reference]
            gaps = [
                _nan(values.get(step)) - _nan(base.get(step))
                if values.get(step) is not None and base.get(step) is not None
                else math.nan
                for step in steps
            ]
            gap_axes.plot(steps, gaps, **style)
    margin = learning_margin(record)["margin"]
    if record.learning.rule == "non-inferiority":
        _draw_horizon(gap_axes, record)
    elif margin is not None:
        gap_axes.axhspan(-margin, margin, color="C2", alpha=0.15, label=f"± margin {margin:.4g}")
        gap_axes.axhline(margin, color="C3", linewidth=1.2, label="a candidate must stay below")
    gap_axes.axhline(0.0, color="black", linewidth=0.8)
    loss_axes.set_ylabel("held-out loss (mean over ranks)")
    loss_axes.legend(fontsize="small")
    loss_axes.grid(alpha=0.3)
    loss_axes.set_title(
        f"Held-out loss per evaluation: {record.workload.name}, "
        f"{record.environment.world_size} ranks"
    )
    gap_axes.set_ylabel(f"loss − {reference or 'reference'}")
    gap_axes.set_xlabel("step")
    gap_axes.grid(alpha=0.3)
    gap_axes.legend(fontsize="small")


def draw_step_times(figure, record: Record) -> None:
    columns = figure.subplots(1, len(record.performance), squeeze=False)[0]
    for axes, performance in zip(columns, record.performance, strict=True):
        blocks = [block.index for block in performance.blocks]
        lines = (
            ("reference step", "reference_step_s", "black", "-"),
            (f"{performance.arm} step", "candidate_step_s", "C0", "-"),
            ("reference gather", "reference_gather_step_s", "black", "--"),
            (f"{performance.arm} gather", "candidate_gather_step_s", "C0", "--"),
        )
        for label, field, color, linestyle in lines:
            values = [getattr(block, field) for block in performance.blocks]
            if any(value is not None for value in values):
                axes.plot(
                    blocks,
                    [_nan(value) * 1e3 for value in values],
                    color=color,
                    linestyle=linestyle,
                    marker="o",
                    label=label,
                )
        axes.set_title(f"{performance.arm}: ms per step, per block")
        axes.set_xlabel("block")
        axes.set_xticks(blocks)
        axes.set_ylabel("ms (block median)")
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
