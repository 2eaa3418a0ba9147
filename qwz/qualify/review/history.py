"""The nightly trend: every night's record side by side, so slow drift is visible.

The nightly gate compares each night with a fixed baseline that only a deliberate
``qwz-qualify promote`` changes; it never replaces the baseline with the night it
just judged (that ratchet lets a 1.5% slowdown a night pass forever, since each
night is within noise of the one before). The nights themselves are kept in a
history directory, and ``qwz-qualify history DIR`` renders them: a markdown table
(one row per night and candidate arm: speed-up with its interval, final losses,
verdict, signature) and one plot (speed-up interval and final loss per night).

Records that cannot be loaded are listed, not skipped silently. A night judged by an older
rule shows both verdicts ([Note: rejudging], qualify/evidence/rejudge.py): "PASS (as judged) /
FAIL under today's rules: learning[candidate-g64]: PASS (rule 1) / FAIL under rule 2" -- a
judge change is never a reason to refuse a night.
"""

from __future__ import annotations

import pathlib
import shutil
from dataclasses import dataclass

from qwz.qualify.evidence.record import load
from qwz.qualify.evidence.rejudge import rejudged, verdict_text
from qwz.qualify.evidence.schema import Record, RecordError
from qwz.qualify.evidence.signing import SigningKey, describe

HISTORY_PLOT = "history.png"


@dataclass(frozen=True)
class Night:
    path: pathlib.Path
    record: Record

    @property
    def stage(self) -> int:
        return self.record.arms[0].stage if self.record.arms else 0

    @property
    def label(self) -> str:
        """Time and head: two records of one head on one day are two points."""
        return f"{self.record.created_at[:19].replace('T', ' ')} {self.record.head.sha[:8]}"


def collect(directory: pathlib.Path) -> tuple[list[Night], list[str]]:
    """Every ``record.json`` under ``directory``, loaded and sorted by creation time, and a
    line for each that could not be loaded."""
    nights, problems = [], []
    for path in sorted(pathlib.Path(directory).rglob("record.json")):
        try:
            nights.append(Night(path, load(path)))
        except RecordError as error:
            problems.append(str(error))
    nights.sort(key=lambda night: (night.record.created_at, str(night.path)))
    return nights, problems


def _final_loss(record: Record, arm: str) -> float | None:
    for trajectory in record.trajectories:
        if trajectory.arm == arm and trajectory.losses:
            return trajectory.losses[-1]
    return None


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _speed_cells(performance) -> tuple[str, str]:
    """The speed-up and interval cells: every valid record has them, measured or not."""
    if performance is None:
        return "not measured (no blocks)", "—"
    if performance.median_speedup is None:
        return f"not measured ({len(performance.blocks)} blocks)", "—"
    return (
        f"{performance.median_speedup:.3f}x",
        f"[{performance.ci_low:.3f}, {performance.ci_high:.3f}]",
    )


def render_markdown(
    nights: list[Night],
    problems: list[str],
    key: SigningKey | None = None,
    plot: str | None = None,
) -> str:
    lines = ["# qwz nightly history", ""]
    if not nights:
        lines.append("No records found.")
    else:
        lines += [
            f"{len(nights)} records, {nights[0].record.created_at} to "
            f"{nights[-1].record.created_at}.",
            "",
            "| night | stage | arm | speed-up | 95% interval | final loss (ref / cand) "
            "| verdict | signature |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for night in nights:
            record = night.record
            reference = _final_loss(record, record.arms[0].name) if record.arms else None
            signature = describe(record.digest, record.signature, key).split(";")[0]
            signature = signature.split(":")[0]
            verdict = verdict_text(record).replace("|", "\\|")
            for performance in record.performance or [None]:
                arm = "—" if performance is None else performance.arm
                speed, interval = _speed_cells(performance)
                lines.append(
                    f"| {night.label} | {night.stage} | {arm} | {speed} | {interval} "
                    f"| {_number(reference)} / "
                    f"{_number(None if performance is None else _final_loss(record, arm))} "
                    f"| {verdict} | {signature} |"
                )
    if plot:
        lines += ["", f"![speed-up and final loss per night]({plot})"]
    if problems:
        lines += ["", "Records that could not be loaded:", ""]
        lines += [f"- {problem}" for problem in problems]
    return "\n".join(lines) + "\n"


def draw_plot(nights: list[Night], out_dir: pathlib.Path) -> dict[str, str]:
    """`write_plot` into `out_dir`, as qualify/review/outputs.py's ``draw_into`` takes it."""
    write_plot(nights, out_dir / HISTORY_PLOT)
    return {"history": HISTORY_PLOT}


def write_plot(nights: list[Night], path: pathlib.Path) -> None:
    """One figure: the speed-up interval per night (top) and the final loss (bottom), one
    series per stage and candidate arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.0, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    speed_axes, loss_axes = figure.subplots(2, 1, sharex=True)
    labels = [night.label for night in nights]  # one x position per record
    series: dict[str, list[tuple[int, float, float, float, float | None]]] = {}
    for x, night in enumerate(nights):
        for performance in night.record.performance or []:
            if performance.median_speedup is None:  # no interval: nothing to draw
                continue
            series.setdefault(f"stage {night.stage} {performance.arm}", []).append(
                (
                    x,
                    performance.median_speedup,
                    performance.ci_low,
                    performance.ci_high,
                    _final_loss(night.record, performance.arm),
                )
            )
    for name, points in series.items():
        xs = [point[0] for point in points]
        medians = [point[1] for point in points]
        below = [point[1] - point[2] for point in points]
        above = [point[3] - point[1] for point in points]
        speed_axes.errorbar(xs, medians, yerr=[below, above], marker="o", capsize=3, label=name)
        losses = [(point[0], point[4]) for point in points if point[4] is not None]
        loss_axes.plot([x for x, _ in losses], [y for _, y in losses], marker="o", label=name)
    speed_axes.axhline(1.0, color="grey", linewidth=0.8)
    speed_axes.set_ylabel("speed-up (median, 95% interval)")
    loss_axes.set_ylabel("final loss (candidate)")
    loss_axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    if series:
        speed_axes.legend(fontsize="small")
    figure.savefig(path, dpi=110)


def promote(record_path: pathlib.Path, baseline_dir: pathlib.Path) -> Record:
    """Make ``record_path`` (a passing, verified record) the baseline in ``baseline_dir``.

    The record and, when present beside it, its report and plots are copied; the record
    is copied last and atomically, so a baseline directory never holds a partial one."""
    record = load(record_path)
    verdict = rejudged(record).verdict
    if not verdict.passed:
        why = verdict.failed or verdict.inconclusive
        raise RecordError(
            f"{record_path}: a record that did not pass cannot become the baseline "
            f"(verdict {verdict.status}: {', '.join(why)}, under today's rules)"
        )
    unmeasured = [item.arm for item in record.performance if item.interval != "bootstrap"]
    if not record.performance or unmeasured:
        raise RecordError(
            f"{record_path}: a baseline needs a speed-up interval for every candidate, or "
            "compare's speed gate is off against it; this record has "
            + (f"none for {', '.join(unmeasured)}" if unmeasured else "no speed blocks")
            + " (run with --blocks 4 or more)"
        )
    baseline_dir.mkdir(parents=True, exist_ok=True)
    source_dir = record_path.parent
    for name in ("report.md", "loss.png", "speedup.png"):
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, baseline_dir / name)
    # The file as written (its signature, its schema): a record is never rewritten.
    copy = baseline_dir / ".record.json.partial"
    shutil.copyfile(record_path, copy)
    copy.replace(baseline_dir / "record.json")
    return record
