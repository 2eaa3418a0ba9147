"""Writing a finished run's files: plots, report, record, and the CI job summary.

[Note: nothing lost after a run]
Once the ranks have finished, the evidence is the record: nothing optional may cost it.
Plots are drawn first into a hidden staging folder and moved into ``--out`` only when
every one was drawn; a plot that fails (matplotlib missing or broken, a figure that
cannot be drawn) leaves no plot and no staging folder, and its error is written into the
report in place of the plots. The report and then the record are each written
atomically (qwz/qualify/base/files.py). The GitHub job summary, written last, only appends.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

from qwz.qualify.base.files import atomic_write_text, move_into

STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


class Drawn:
    """The plot files drawn (name -> file name in the output directory), or why none."""

    def __init__(self, plots: dict[str, str], problem: str | None):
        self.plots = plots
        self.problem = problem

    def note(self) -> str:
        """The report's section for plots that could not be drawn; empty when drawn."""
        if self.problem is None:
            return ""
        return (
            f"\n## Plots\n\nNot drawn: {self.problem}. The record and this report are "
            "complete without them ([Note: nothing lost after a run], "
            "qwz/qualify/review/outputs.py).\n"
        )


def draw_into(out: pathlib.Path, draw: Callable[[pathlib.Path], dict[str, str]]) -> Drawn:
    """[Note: nothing lost after a run]: `draw(staging)` returns name -> file name of the
    plots it wrote there; they are moved into `out` together, or none is."""
    out.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".plots-", dir=out))
    try:
        plots = draw(staging)
    except Exception as error:  # any failure of an optional plot; the record is what counts
        shutil.rmtree(staging, ignore_errors=True)
        message = " ".join(str(error).split()) or "no message"
        return Drawn({}, f"{type(error).__name__}: {message}")
    move_into(staging, list(plots.values()), out)
    return Drawn(plots, None)


def append_job_summary(markdown: str) -> pathlib.Path | None:
    """Append `markdown` to the file ``GITHUB_STEP_SUMMARY`` names (GitHub Actions' job
    summary); nothing where it is unset. Returns the file written."""
    target = os.environ.get(STEP_SUMMARY_ENV)
    if not target:
        return None
    path = pathlib.Path(target)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(markdown.rstrip("\n") + "\n\n")
    return path


def write_run_outputs(built, out: pathlib.Path, key, signature_section) -> Drawn:
    """Plots, report and record of a finished run into `out`, then the job summary."""
    from qwz.qualify.evidence import record
    from qwz.qualify.review import plots, report, summary

    drawn = draw_into(out, lambda staging: plots.write_plots(built, staging))
    text = report.render_markdown(built, drawn.plots) + drawn.note() + signature_section
    atomic_write_text(out / "report.md", text)
    record.save(built, out / "record.json")
    append_job_summary(summary.record_summary(built))
    return drawn


def scheme_sentence(record) -> str | None:
    """The scheme the record's candidates wrote and what it cost, for the console; None where
    nothing was quantized ([Note: what a scheme costs], qualify/run/observers/scheme_cost.py)."""
    from qwz.qualify.evidence.rules.schemes import scheme_report

    report = scheme_report(record)
    if report.arm is None and report.scheme is None and not report.mixed:
        return None
    return report.sentence()
