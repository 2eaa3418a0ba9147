"""The plots a reviewer judges by: losses, held-out loss against the margin, speed-ups and
times per step.

``write_plots`` draws each on a matplotlib ``Figure`` with the Agg canvas, without pyplot, so
it never touches a global backend or opens a window. Every number drawn is in the record.

* ``loss.png``: every arm's training loss per step, and each candidate's difference from the
  reference.
* ``speedup.png``: per candidate, each block's speed-up with the median and its interval.
* ``held_out.png``: the held-out loss of every arm at each evaluation step (the
  ``learning`` checks judge these, [Note: learning margin], qualify/evidence/rules/learning.py), and
  below it each arm's difference from the reference with the margin a candidate must stay
  under; the calibration arm, whose gap sets the margin, is drawn as the arms are.
* ``step_times.png``: per candidate, the median ms/step of each block for the reference
  and the candidate, and the median ms of their weight gathers in those steps ([Note:
  gather phase timing], qualify/run/gather_timing.py) where they were measured.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

import numpy as np

from qwz.qualify.evidence.schema import Record
from qwz.qualify.review.formatting import (
    format_interval,
    format_p,
    format_speedup,
    reference_arm,
    short_hash,
)


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
    from qwz.qualify.evidence.rules.learning import learning_margin

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


def write_plots(record: Record, out_dir: pathlib.Path) -> dict[str, str]:
    """Write ``loss.png`` and (when the record has performance blocks) ``speedup.png``.

    Returns plot name -> file name relative to ``out_dir``, as ``render_markdown``
    takes it.
    """
    # matplotlib is an optional dependency (the ``qualify`` extra): import it only here.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {}

    figure = Figure(figsize=(8.0, 6.0), layout="constrained")
    FigureCanvasAgg(figure)
    _draw_losses(figure, record)
    figure.savefig(out_dir / "loss.png", dpi=110)
    plots["loss"] = "loss.png"

    if record.learning.eval_steps:
        figure = Figure(figsize=(8.0, 6.0), layout="constrained")
        FigureCanvasAgg(figure)
        draw_held_out(figure, record)
        figure.savefig(out_dir / "held_out.png", dpi=110)
        plots["held_out"] = "held_out.png"

    if record.performance:
        columns = len(record.performance)
        figure = Figure(figsize=(4.0 + 3.5 * columns, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        _draw_speedups(figure, record)
        figure.savefig(out_dir / "speedup.png", dpi=110)
        plots["speedup"] = "speedup.png"
        figure = Figure(figsize=(4.0 + 3.5 * columns, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        draw_step_times(figure, record)
        figure.savefig(out_dir / "step_times.png", dpi=110)
        plots["step_times"] = "step_times.png"
    return plots


def _floats(values: Sequence[float | None]) -> list[float]:
    return [math.nan if value is None else value for value in values]


def _draw_losses(figure, record: Record) -> None:
    reference = reference_arm(record)
    reference_losses = next(
        (t.losses for t in record.trajectories if reference and t.arm == reference.name), None
    )
    candidates = [t for t in record.trajectories if reference is None or t.arm != reference.name]
    with_difference = reference_losses is not None and bool(candidates)
    if with_difference:
        loss_axes, difference_axes = figure.subplots(
            2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
        )
    else:
        loss_axes, difference_axes = figure.subplots(), None

    for index, trajectory in enumerate(record.trajectories):
        steps = np.arange(1, len(trajectory.losses) + 1)
        is_reference = reference is not None and trajectory.arm == reference.name
        loss_axes.plot(
            steps,
            _floats(trajectory.losses),
            label=trajectory.arm,
            color="black" if is_reference else f"C{index}",
            linewidth=2.4 if is_reference else 1.4,
            linestyle="-" if is_reference else "--",
            marker=None if is_reference else "o",
            markersize=3,
        )
    loss_axes.set_ylabel("loss (mean over ranks)")
    loss_axes.legend(title="arm")
    loss_axes.grid(alpha=0.3)
    loss_axes.set_title(
        f"Loss per step: {record.workload.name}, {record.environment.world_size} ranks, "
        f"head {short_hash(record.head.sha)}"
    )

    if difference_axes is not None:
        for index, trajectory in enumerate(record.trajectories):
            if trajectory in candidates and len(trajectory.losses) == len(reference_losses):
                steps = np.arange(1, len(trajectory.losses) + 1)
                difference = np.subtract(_floats(trajectory.losses), _floats(reference_losses))
                difference_axes.plot(steps, difference, color=f"C{index}", marker="o", markersize=3)
        difference_axes.axhline(0.0, color="black", linewidth=0.8)
        difference_axes.set_ylabel(f"loss − {reference.name}")
        difference_axes.grid(alpha=0.3)
        difference_axes.set_xlabel("step")
    else:
        loss_axes.set_xlabel("step")
    (difference_axes or loss_axes).xaxis.get_major_locator().set_params(integer=True)


def _draw_speedups(figure, record: Record) -> None:
    all_axes = figure.subplots(1, len(record.performance), sharey=True, squeeze=False)[0]
    for axes, performance in zip(all_axes, record.performance, strict=True):
        blocks = np.array([block.index for block in performance.blocks])
        speedups = np.array([block.speedup for block in performance.blocks])
        if performance.median_speedup is not None:
            axes.axhspan(
                performance.ci_low,
                performance.ci_high,
                color="C0",
                alpha=0.18,
                label=f"95% interval {format_interval(performance.ci_low, performance.ci_high)}",
            )
            axes.axhline(
                performance.median_speedup,
                color="C0",
                linewidth=1.8,
                label=f"median {format_speedup(performance.median_speedup)}",
            )
        axes.axhline(1.0, color="0.3", linestyle="--", linewidth=1.2, label="1.0 (no change)")
        for order, marker, color in (("AB", "o", "C1"), ("BA", "s", "C2")):
            chosen = np.array([block.order == order for block in performance.blocks], bool)
            if chosen.any():
                axes.scatter(
                    blocks[chosen],
                    speedups[chosen],
                    marker=marker,
                    color=color,
                    s=48,
                    zorder=3,
                    label=f"block, {order} order",
                )
        p_text = "n/a" if performance.p_value is None else format_p(performance.p_value)
        axes.set_title(f"{performance.arm} (p = {p_text})")
        axes.set_xlabel("block")
        axes.set_xticks(blocks)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small", loc="best")
        axes.margins(x=0.15)
    # One y scale for every arm (the axes share it), with 1.0 in view so the distance to
    # "no change" reads at a glance.
    values = [1.0]
    for performance in record.performance:
        values += [block.speedup for block in performance.blocks]
        values += [
            value
            for value in (performance.ci_low, performance.ci_high, performance.median_speedup)
            if value is not None
        ]
    margin = 0.15 * (max(values) - min(values)) or 0.01
    all_axes[0].set_ylim(min(values) - margin, max(values) + margin)
    all_axes[0].set_ylabel("speed-up (reference / candidate step time)")
    figure.suptitle(
        f"Per-block speed-up: {record.workload.name}, {record.environment.world_size} ranks "
        "(> 1: candidate faster)"
    )
