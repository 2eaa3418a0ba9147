"""The markdown and the plots of ``qwz/qualify/review/report.py``, from the synthetic record."""

from __future__ import annotations

import pytest

from qwz.qualify.evidence import seal
from qwz.qualify.evidence.stats import METHOD_NOTE
from qwz.qualify.review import formatting, plots, report
from tests.unit.records import (
    CANDIDATE,
    HEAD_SHA,
    REFERENCE,
    make_payload,
    make_record,
    non_finite_failure,
    violation,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def passing():
    return make_record()


def failing_record():
    payload = make_payload()
    payload["updates"][2] |= {
        "violations": 3,
        "max_ratio": 2.75,
        "first_violation": violation(step=7, rank=1, ratio=2.75),
    }
    payload["probes"][0]["reported_group_sizes"] = [64, 8192]
    return make_record(updates=payload["updates"], probes=payload["probes"])


def test_markdown_of_a_passing_record(passing):
    markdown = report.render_markdown(passing)
    assert markdown.startswith("# qwz qualification: PASS\n")
    assert f"All {len(passing.checks)} checks that carried evidence passed." in markdown
    assert "**Median speed-up 1.037x [1.036, 1.039]**" in markdown
    for check in passing.checks:
        assert f"| `{check.name}` | PASS | {check.detail} |" in markdown
    assert "| `candidate-g64` | 3 digests | 40,960 | 0 | 0.49 | — | 0.998 |" in markdown
    assert "rank 0: 64, rank 1: 64" in markdown
    assert "| 615,468 | 1,158,528 | 0.531x |" in markdown
    assert HEAD_SHA in markdown and "| uncommitted changes | no |" in markdown
    assert "| devices | 2 × NVIDIA H200 |" in markdown
    assert "| world size | 2 ranks on 1 node |" in markdown
    assert "1,158,528 parameters, 20 steps, seed 1234" in markdown
    assert f"| `{REFERENCE}` | no | off | 2 | bf16 |" in markdown
    assert "| 0 | AB | 41.53 | 40.05 | 1.037x |" in markdown
    assert "| 1 | BA | 41.50 | 40.05 | 1.036x |" in markdown
    assert "| `candidate-g64` | 0 | cuda | 58.5 MiB | 78.0 MiB |" in markdown
    assert "`52367a6622b1` on all 2 ranks | yes | reproduced" in markdown
    assert "| 20 | 5.8716 | 5.8717 | 5.8713 |" in markdown  # held-out losses
    assert "Margin 0.01801 = max(3 × the `calibration-g64` arm's largest gap" in markdown
    assert METHOD_NOTE in markdown
    assert "![" not in markdown  # no plots given, none linked


def test_markdown_of_a_failing_record():
    markdown = report.render_markdown(failing_record())
    assert markdown.startswith("# qwz qualification: FAIL\n")
    assert "**Failed checks:** `update[candidate-g64]`, `probe[candidate-g64]`." in markdown
    assert "| `update[candidate-g64]` | **FAIL** | 3 of 40960 sampled master updates" in markdown
    assert "| **3** | 2.75 | step 7, rank 1, lm_head.weight: expected 0.1, got 0.2 |" in markdown
    assert "rank 0: 64, rank 1: 8192" in markdown


def test_markdown_of_a_diverged_run_names_the_step():
    payload = make_payload()
    candidate = payload["trajectories"][2]
    candidate |= {
        "losses": [*candidate["losses"][:3], None],
        "grad_norms": [*candidate["grad_norms"][:3], None],
        "held_out": candidate["held_out"][:1],
        "failure": non_finite_failure(4, 0, "NonFiniteError: step 4: non-finite gradient"),
    }
    record = make_record(trajectories=payload["trajectories"])
    markdown = report.render_markdown(record)
    assert "## Failures" in markdown
    assert "| `candidate-g64` | 4 | 0, 1 | non-finite | lm_head.weight |" in markdown


def test_markdown_of_an_inconclusive_record():
    payload = make_payload()
    for trajectory in payload["trajectories"]:
        for point in trajectory["held_out"]:
            point["loss"] = 7.6728
    markdown = report.render_markdown(make_record(trajectories=payload["trajectories"]))
    assert markdown.startswith("# qwz qualification: INCONCLUSIVE\n")
    assert "**Inconclusive:** `learning[reference]`" in markdown


def test_trajectory_summary(passing):
    markdown = report.render_markdown(passing)
    losses = passing.trajectories[0].losses
    row = next(line for line in markdown.splitlines() if line.startswith(f"| `{REFERENCE}` | 20"))
    assert formatting.format_sig(losses[0]) in row and formatting.format_sig(losses[-1]) in row
    assert "| yes |" in row
    candidate_row = next(
        line for line in markdown.splitlines() if line.startswith(f"| `{CANDIDATE}` | 20")
    )
    assert candidate_row.endswith("| 4.00e-04 |")


def test_a_record_with_insufficient_blocks_says_so(tmp_path):
    payload = make_payload()
    payload["performance"][0]["blocks"] = payload["performance"][0]["blocks"][:2]
    record = make_record(performance=payload["performance"])
    assert "**Insufficient blocks** for an interval" in report.render_markdown(record)
    assert "speedup" in plots.write_plots(record, tmp_path)


def test_table_cells_are_escaped():
    payload = make_payload()
    payload["trajectories"][2]["failure"] = {
        "step": 1,
        "rank": 0,
        "ranks": [0],
        "kind": "error",
        "message": "RuntimeError: a | b\nc",
        "parameters": [],
    }
    markdown = report.render_markdown(make_record(trajectories=payload["trajectories"]))
    assert "RuntimeError: a \\| b<br>c" in markdown


def test_plots_are_written_and_linked(tmp_path, passing):
    written = plots.write_plots(passing, tmp_path / "plots")
    assert written == {
        "loss": "loss.png",
        "held_out": "held_out.png",
        "speedup": "speedup.png",
        "step_times": "step_times.png",
    }
    for file_name in written.values():
        content = (tmp_path / "plots" / file_name).read_bytes()
        assert content.startswith(PNG_MAGIC) and len(content) > 10_000
    markdown = report.render_markdown(passing, written)
    assert "![Loss per step](loss.png)" in markdown
    assert "![Speed-up per block](speedup.png)" in markdown


def test_plots_of_a_record_without_performance(tmp_path):
    written = plots.write_plots(make_record(performance=[]), tmp_path)
    assert written == {"loss": "loss.png", "held_out": "held_out.png"}
    assert "No performance blocks" in report.render_markdown(make_record(performance=[]))


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.0, "1.000"), (41.532, "41.53"), (0.041532, "0.04153"), (12345.6, "12350"), (0.0, "0.000")],
)
def test_format_sig(value, text):
    assert formatting.format_sig(value) == text


def test_format_bytes():
    assert formatting.format_bytes(512) == "512 B"
    assert formatting.format_bytes(61_341_696) == "58.5 MiB"
    assert formatting.format_bytes(30_980_000_000) == "28.85 GiB"


def native_record(**edit):
    subject = {
        "name": "deepspeed-native", "version": "0.19.8", "sha": "2" * 40, "dirty": True,
        "diff_sha256": "d" * 64, "import_path": "/src/DeepSpeed/deepspeed",
        "installed_commit": "1111111",
    }  # fmt: skip
    head = {"repository": "/src/DeepSpeed", "sha": "2" * 40, "dirty": True, "diff_sha256": "d" * 64}
    return make_record(subject=subject, head=head, **edit)


def test_a_native_deepspeed_report_names_its_subject_and_what_it_only_requested():
    """Not "qwz qualification", not "quantized yes": DeepSpeed's own code decides."""
    markdown = report.render_markdown(native_record())
    assert markdown.startswith(
        "# DeepSpeed qualification (DeepSpeed's own code), deepspeed 0.19.8 at 222222222222 "
        "(dirty): "
    )
    assert "| `candidate-g64` | requested | 64 | 2 | bf16 |" in markdown
    assert "| `reference` | no | off | 2 | bf16 |" in markdown
    assert "Subject `deepspeed-native`: every arm is DeepSpeed's own ZeRO-1/2" in markdown
    assert f"| deepspeed commit | `{'2' * 40}` |" in markdown
    assert "| commit recorded at install (context) | `1111111` |" in markdown
    assert "| imported from | /src/DeepSpeed/deepspeed |" in markdown
    assert "(diff sha256 `dddddddddddd`)" in markdown


def test_stock_deepspeed_through_the_drop_in_says_so():
    payload = make_payload(subject={"name": "deepspeed", "version": "0.19.8", "sha": None})
    for arm in payload["arms"]:
        arm["qwz_gather"] = False
    markdown = report.render_markdown(seal.seal(payload))
    assert markdown.startswith("# Stock DeepSpeed qualification (qwz's gather disabled): ")
    assert "| `candidate-g64` | requested | 64 |" in markdown
    payload["arms"][2]["qwz_gather"] = True
    markdown = report.render_markdown(seal.seal(payload))
    assert markdown.startswith("# DeepSpeed + qwz's gather qualification, deepspeed 0.19.8: ")
    assert "| `candidate-g64` | yes | 64 |" in markdown
