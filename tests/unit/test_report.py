"""The markdown and the plots of ``qwz/qualify/report.py``, from the synthetic record."""

from __future__ import annotations

import pytest

from qwz.qualify import report
from qwz.qualify.stats import METHOD_NOTE

from .records import CANDIDATE, HEAD_SHA, REFERENCE, make_payload, make_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def passing():
    return make_record()


def failing_record():
    payload = make_payload()
    payload["checks"][1] |= {"passed": False, "detail": "3 of 10240 sampled parameters outside"}
    payload["tolerance"][0] |= {"violations": 3, "max_ratio": 2.75}
    payload["probes"][0]["reported_group_sizes"] = [64, 8192]
    return make_record(checks=payload["checks"], tolerance=payload["tolerance"],
                       probes=payload["probes"])  # fmt: skip


def test_markdown_of_a_passing_record(passing):
    markdown = report.render_markdown(passing)
    assert markdown.startswith("# qwz qualification: PASS\n")
    assert "**Median speed-up 1.037x [1.036, 1.039]**" in markdown
    assert "p = 9.4e-06" in markdown
    for check in passing.checks:
        assert f"| `{check.name}` | PASS | {check.detail} |" in markdown
    assert "| `candidate-g64` | 512 | 20 | 10,240 | 0 |" in markdown  # violations: 0
    assert "rank 0: 64, rank 1: 64" in markdown
    assert "| 615,468 | 1,158,528 | 0.531x |" in markdown
    assert HEAD_SHA in markdown and "| uncommitted changes | no |" in markdown
    assert "| devices | 2 × NVIDIA H200 |" in markdown
    assert "| world size | 2 ranks on 1 node |" in markdown
    assert "1,158,528 parameters, 20 steps, seed 1234" in markdown
    assert f"| `{REFERENCE}` | no | off | 2 | bfloat16 |" in markdown
    assert "| 0 | AB | 41.53 | 40.05 | 1.037x |" in markdown
    assert "| 1 | BA | 41.50 | 40.05 | 1.036x |" in markdown
    assert "| 0 | cuda | 58.5 MiB | 78.0 MiB |" in markdown
    assert "`52367a6622b1` on all 2 ranks | yes | reproduced" in markdown
    assert METHOD_NOTE in markdown
    assert "![" not in markdown  # no plots given, none linked


def test_markdown_of_a_failing_record():
    markdown = report.render_markdown(failing_record())
    assert markdown.startswith("# qwz qualification: FAIL\n")
    assert "**Failed checks:** `tolerance`." in markdown
    assert "| `tolerance` | **FAIL** | 3 of 10240 sampled parameters outside |" in markdown
    assert "| **3** | 2.75 |" in markdown
    assert "rank 0: 64, rank 1: 8192" in markdown


def test_trajectory_summary(passing):
    markdown = report.render_markdown(passing)
    losses = passing.trajectories[0].losses
    row = next(line for line in markdown.splitlines() if line.startswith(f"| `{REFERENCE}` | 20"))
    assert report.format_sig(losses[0]) in row and report.format_sig(losses[-1]) in row
    assert "| yes |" in row
    candidate_row = next(
        line for line in markdown.splitlines() if line.startswith(f"| `{CANDIDATE}` | 20")
    )
    assert candidate_row.endswith("| 4.00e-04 |")


def test_table_cells_are_escaped():
    checks = make_payload()["checks"]
    checks[0]["detail"] = "loss | grad norm\nboth finite"
    markdown = report.render_markdown(make_record(checks=checks))
    assert "loss \\| grad norm<br>both finite" in markdown


def test_plots_are_written_and_linked(tmp_path, passing):
    plots = report.write_plots(passing, tmp_path / "plots")
    assert plots == {"loss": "loss.png", "speedup": "speedup.png"}
    for file_name in plots.values():
        content = (tmp_path / "plots" / file_name).read_bytes()
        assert content.startswith(PNG_MAGIC) and len(content) > 10_000
    markdown = report.render_markdown(passing, plots)
    assert "![Loss per step](loss.png)" in markdown
    assert "![Speed-up per block](speedup.png)" in markdown


def test_plots_of_a_record_without_performance(tmp_path):
    plots = report.write_plots(make_record(performance=[]), tmp_path)
    assert plots == {"loss": "loss.png"}
    assert "No performance blocks" in report.render_markdown(make_record(performance=[]))


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.0, "1.000"), (41.532, "41.53"), (0.041532, "0.04153"), (12345.6, "12350"), (0.0, "0.000")],
)
def test_format_sig(value, text):
    assert report.format_sig(value) == text


def test_format_bytes():
    assert report.format_bytes(512) == "512 B"
    assert report.format_bytes(61_341_696) == "58.5 MiB"
    assert report.format_bytes(30_980_000_000) == "28.85 GiB"
