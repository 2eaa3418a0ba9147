"""A record as the evidence section of a pull request: the markdown a reviewer reads.

``render_markdown`` only reads the record: every number it prints is in the record, so a
reviewer can check the report against the file (whose digest the report prints). Number and
table formats are formatting.py's; the plots (linked from here) are plots.py's.
"""

from __future__ import annotations

import json

from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.schema import Arm, Record
from qwz.qualify.evidence.stats import METHOD_NOTE
from qwz.qualify.review import report_observations, report_sections
from qwz.qualify.review.banner import banner
from qwz.qualify.review.conformance_section import conformance_section
from qwz.qualify.review.formatting import (
    devices,
    format_interval,
    format_p,
    format_sig,
    format_speedup,
    group_size_text,
    is_finite,
    reference_arm,
    short_hash,
    table,
)

_STATUS = {"pass": "PASS", "fail": "**FAIL**", "n/a": "n/a", "inconclusive": "*inconclusive*"}


def render_markdown(record: Record, plots: dict[str, str] | None = None) -> str:
    """The record as markdown; ``plots`` (from ``write_plots``) are linked relative to it."""
    lines = _verdict_lines(record)
    for section in (
        _failures_section,
        _code_section,
        _environment_section,
        _workload_section,
        _arms_section,
        _trajectory_section,
        _learning_section,
        report_observations.exactness_section,
        report_observations.drift_section,
        report_observations.hashes_section,
        report_observations.probe_section,
        conformance_section,
        report_observations.memory_section,
        _performance_section,
        report_sections.reproduce_section,
    ):
        lines += section(record)
    lines += ["## Checks", ""]
    lines += table(
        ["check", "result", "detail"],
        [(f"`{check.name}`", _STATUS[check.status], check.detail) for check in record.checks],
    )
    lines += _plot_lines(plots or {})
    lines += ["---", "", f"*Method.* {METHOD_NOTE}", ""]
    return "\n".join(lines)


def _verdict_lines(record: Record) -> list[str]:
    """The title, the banner, the verdict and what decided it."""
    verdict, environment = record.verdict, record.environment
    arm_names = [arm.name for arm in record.arms]
    substituted = record.subject.substituted_ops
    lines = [
        f"# {title(record)}: {verdict.status}"
        + (" (its quantizer op ran as the harness's CPU implementation)" if substituted else ""),
        "",
        f"**{record.workload.name}**, arms {', '.join(f'`{name}`' for name in arm_names)}, "
        f"{devices(environment.device_names)} ({environment.backend}), "
        f"head `{short_hash(record.head.sha)}`{' (dirty)' if record.head.dirty else ''}.",
        "",
        f"> **{banner(record)}**",  # [Note: verdict banner], qualify/review/banner.py
        "",
        *(f"> **Substituted:** {op}." for op in substituted),
        *([""] if substituted else []),
        *report_sections.scheme_lines(record),
    ]
    evidence = len(verdict.evidence)
    if verdict.status == "PASS":
        lines += [f"All {evidence} checks that carried evidence passed.", ""]
    if verdict.failed:
        failed = ", ".join(f"`{name}`" for name in verdict.failed)
        lines += [f"**Failed checks:** {failed}.", ""]
    if verdict.inconclusive:
        names = ", ".join(f"`{name}`" for name in verdict.inconclusive)
        why = "; ".join(check.detail for check in record.checks if check.status == "inconclusive")
        lines += [f"**Inconclusive:** {names}: {why}.", ""]
    not_applicable = verdict.not_applicable
    return [
        *lines,
        f"Checks with evidence: {evidence}; not applicable: {len(not_applicable)}"
        + (" (" + "; ".join(not_applicable) + ")" if not_applicable else "")
        + ".",
        "",
        f"Record written {record.created_at}, schema version "
        f"{record.upgraded_from or record.schema_version}, digest `{short_hash(record.digest)}`.",
        "",
        *_judge_lines(record),
    ]


PLOT_TITLES = {
    "loss": "Loss per step",
    "held_out": "Held-out loss per evaluation, with the margin",
    "speedup": "Speed-up per block",
    "step_times": "ms per step and per gather, per block",
}


def _plot_lines(plots: dict[str, str]) -> list[str]:
    if not plots:
        return []
    lines = ["## Plots", ""]
    for name, file_name in plots.items():
        lines += [f"![{PLOT_TITLES.get(name, name)}]({file_name})", ""]
    return lines


SUBJECT_TITLES = {
    "qwz": "qwz qualification",
    "deepspeed": "DeepSpeed + qwz's gather qualification",
    "deepspeed-native": "DeepSpeed qualification (DeepSpeed's own code)",
}


def title(record: Record) -> str:
    """Which subject ran, and in which mode: the drop-in with the takeover disabled runs
    stock DeepSpeed for every arm."""
    subject = record.subject
    if subject.name == "deepspeed" and not any(arm.qwz_gather for arm in record.arms):
        return "Stock DeepSpeed qualification (qwz's gather disabled)"
    text = SUBJECT_TITLES[subject.name]
    if subject.name != "qwz":
        text += f", deepspeed {subject.version}"
        if subject.sha:
            text += f" at {short_hash(subject.sha)}{' (dirty)' if subject.dirty else ''}"
    return text


def _quantized(record: Record, arm: Arm) -> str:
    """ "yes" where qwz's code quantizes; "requested" where the subject's own code decides
    (stock DeepSpeed, DeepSpeed's own implementation) -- the probe says what it did."""
    if not arm.quantized:
        return "no"
    qwz_decides = record.subject.name == "qwz" or (
        record.subject.name == "deepspeed" and arm.qwz_gather
    )
    return "yes" if qwz_decides else "requested"


def _judge_lines(record: Record) -> list[str]:
    """Who judged the record, and what today's rules say where they moved a result ([Note:
    rejudging], qualify/evidence/rejudge.py)."""
    judge = record.judge
    who = (
        "a judge before rules were versioned (schema 2: rule 0)"
        if judge is None
        else f"qwz {judge.version}'s judge (constants `{short_hash(judge.constants_sha256)}`)"
    )
    judged = rejudged(record)
    moved = [item.text() for item in judged.judge_changes if item.result_changed]
    lines = [f"Judged by {who}; under today's rules the verdict is {judged.verdict.status}."]
    if moved:
        lines += ["", "Judge changes (as judged / under today's rule):", ""]
        lines += [f"- {text}" for text in moved]
    return [*lines, ""]


def _failures_section(record: Record) -> list[str]:
    ended = [t for t in record.trajectories if t.failure is not None]
    failed = [t for t in ended if t.failure.kind != "not-run"]
    not_run = [f"`{t.arm}`" for t in ended if t.failure.kind == "not-run"]
    if not ended:
        return []
    rows = [
        (
            f"`{t.arm}`",
            t.failure.step,
            ", ".join(str(rank) for rank in t.failure.ranks),
            t.failure.kind,
            ", ".join(t.failure.parameters) or "—",
            t.failure.message,
        )
        for t in failed
    ]
    lines = ["## Failures", ""]
    if rows:
        lines += table(["arm", "step", "ranks", "kind", "non-finite parameters", "message"], rows)
    for t in failed:
        lines += _crash_lines(t.arm, t.failure) if t.failure.kind == "crash" else []
    if not_run:
        lines += [f"Not run (the run ended before they started): {', '.join(not_run)}.", ""]
    return lines


def _crash_lines(arm: str, failure) -> list[str]:
    """What the launcher knows of the rank that failed first, and of the others."""
    details = {
        "phase": failure.phase,
        "last completed step": failure.last_completed_step,
        "signal": failure.signal,
        "exit code": failure.exit_code,
    }
    how = [f"{name} {value}" for name, value in details.items() if value is not None]
    lines = [f"`{arm}` crashed on rank {failure.rank}: {'; '.join(how) or 'no details'}.", ""]
    if failure.traceback:
        lines += ["```", *failure.traceback, "```", ""]
    if failure.context:
        lines += ["Then (consequences, not the cause):", ""]
        lines += [f"- {item}" for item in failure.context] + [""]
    return lines


def _code_section(record: Record) -> list[str]:
    head, subject, harness = record.head, record.subject, record.harness
    dirty = "**yes**: the SHA alone does not identify the code" if head.dirty else "no"
    if head.dirty and head.diff_sha256:
        dirty += f" (diff sha256 `{short_hash(head.diff_sha256)}`)"
    package = "qwz" if subject.name == "qwz" else "deepspeed"
    rows = [
        ("subject", f"`{subject.name}`: {package} {subject.version}"),
        ("repository", head.repository),
        ("head SHA", f"`{head.sha}`"),
        ("uncommitted changes", dirty),
        ("imported from", subject.import_path or "—"),
    ]
    if subject.name != "qwz":
        rows.append(("deepspeed commit", f"`{subject.sha}`" if subject.sha else "no checkout"))
    if subject.installed_commit:
        rows.append(("commit recorded at install (context)", f"`{subject.installed_commit}`"))
    if subject.direct_url:
        rows.append(("direct_url.json", f"`{json.dumps(subject.direct_url, sort_keys=True)}`"))
    if harness is not None:
        harness_dirty = " (dirty)" if harness.dirty else ""
        rows.append(("harness (qwz)", f"`{short_hash(harness.sha)}`{harness_dirty}"))
    return ["## Code under test", "", *table(["", ""], rows)]


def _environment_section(record: Record) -> list[str]:
    environment = record.environment
    return [
        "## Environment",
        "",
        *table(
            ["", ""],
            [
                ("python", environment.python),
                ("torch", environment.torch),
                ("deepspeed", environment.deepspeed or "not installed"),
                ("transformers", environment.transformers or "not installed"),
                ("backend", environment.backend),
                ("devices", devices(environment.device_names)),
                (
                    "world size",
                    f"{environment.world_size} ranks on {environment.node_count} "
                    f"node{'s' if environment.node_count != 1 else ''}",
                ),
                ("platform", environment.platform),
                *report_sections.machine_rows(record),
                ("fingerprint", f"`{environment.fingerprint()}`"),
            ],
        ),
    ]


def _workload_section(record: Record) -> list[str]:
    workload = record.workload
    return [
        "## Workload",
        "",
        f"`{workload.name}`: {workload.num_parameters:,} parameters, {workload.steps} steps, "
        f"seed {workload.seed}.",
        "",
        *table(
            ["parameter", "value"],
            [(f"`{key}`", json.dumps(value)) for key, value in workload.params.items()],
        ),
    ]


def _arms_section(record: Record) -> list[str]:
    lines = ["## Arms", "", f"Subject `{record.subject.name}`: {_mode(record)}.", ""]
    lines += table(
        ["arm", "quantized", "group size", "ZeRO stage", "dtype", "allgather bucket"],
        [
            (f"`{arm.name}`", _quantized(record, arm), group_size_text(arm.group_size), arm.stage,
             arm.dtype, _bucket_text(arm.allgather_bucket_size))
            for arm in record.arms
        ],
    )  # fmt: skip
    ds_config = record.plan.ds_config
    if ds_config is not None:  # [Note: the user's DeepSpeed config] (qualify/request/ds_config.py)
        lines += [
            "",
            f"Every arm is built on the DeepSpeed config `{ds_config.path}` (sha256 "
            f"`{ds_config.sha256[:16]}`): over it the harness set the quantization keys per "
            "arm, the stage, the dtype, the batch keys, an optimizer or fp16 section only where "
            "the file has none"
            + (f", and from flags {', '.join(f'`{key}`' for key in ds_config.from_flags)}"
               if ds_config.from_flags else "")
            + ".",
        ]  # fmt: skip
    lines.append("")
    for arm in record.arms:
        lines += [
            f"<details><summary>config of <code>{arm.name}</code></summary>",
            "",
            "```json",
            json.dumps(arm.config, indent=2, sort_keys=True),
            "```",
            "",
            "</details>",
            "",
        ]
    return lines


def _bucket_text(bucket: int | None) -> str:
    """An arm's ``allgather_bucket_size`` (the chunked arm's is its own: [Note: the chunked
    arm], qualify/run/chunked_arm.py)."""
    return "-" if bucket is None else f"{bucket:,}"


def _mode(record: Record) -> str:
    name = record.subject.name
    if name == "qwz":
        return "every arm is qwz's engine; candidates quantize with qwz's gather"
    if name == "deepspeed-native":
        return (
            "every arm is DeepSpeed's own ZeRO-1/2 (a plain deepspeed.initialize, nothing of qwz "
            "inside), each config passed through untouched; whether a candidate quantizes is "
            "DeepSpeed's code's to decide, and the probe reads it off the wire"
        )
    if any(arm.qwz_gather for arm in record.arms):
        return "stock DeepSpeed is the reference; candidates are DeepSpeed with qwz's gather"
    return "stock DeepSpeed for every arm (qwz's gather disabled): candidates only request it"


def _trajectory_section(record: Record) -> list[str]:
    reference = reference_arm(record)
    reference_losses = next(
        (t.losses for t in record.trajectories if reference and t.arm == reference.name), None
    )
    rows = []
    for trajectory in record.trajectories:
        losses, norms = trajectory.losses, trajectory.grad_norms
        finite = all(is_finite(value) for value in [*losses, *norms])
        finite_norms = [value for value in norms if is_finite(value)]
        norm_range = (
            f"{format_sig(min(finite_norms))} – {format_sig(max(finite_norms))}"
            if finite_norms
            else "—"
        )
        is_reference = reference is not None and trajectory.arm == reference.name
        rows.append(
            (
                f"`{trajectory.arm}`",
                len(losses),
                format_sig(losses[0]) if losses and is_finite(losses[0]) else "—",
                format_sig(losses[-1]) if losses and is_finite(losses[-1]) else "—",
                _min_loss(losses),
                "yes" if finite else "**no**",
                norm_range,
                "—" if is_reference else _loss_difference(losses, reference_losses, finite),
            )
        )
    reference_name = reference.name if reference else "reference"
    header = ["arm", "steps", "first loss", "last loss", "min loss", "all finite"]
    header += ["grad norm range", f"max abs loss difference vs `{reference_name}`"]
    return ["## Trajectory", "", *table(header, rows)]


def _min_loss(losses: list[float | None]) -> str:
    """The lowest finite loss and its step."""
    finite_losses = [value for value in losses if is_finite(value)]
    if not finite_losses:
        return "—"
    lowest = min(finite_losses)
    return f"{format_sig(lowest)} (step {losses.index(lowest) + 1})"


def _loss_difference(
    losses: list[float | None], reference_losses: list[float | None] | None, finite: bool
) -> str:
    """The largest absolute per-step loss difference from the reference's."""
    if reference_losses is None:
        return "—"
    comparable = (
        losses
        and len(losses) == len(reference_losses)
        and finite
        and all(is_finite(value) for value in reference_losses)
    )
    if not comparable:
        return "n/a"
    return format_sig(max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)), 3)


def _learning_section(record: Record) -> list[str]:
    from qwz.qualify.evidence.rules.learning import learning_margin

    learning = record.learning
    lines = ["## Learning (held-out loss)", ""]
    series = {t.arm: {h.step: h.loss for h in t.held_out} for t in record.trajectories}
    lines += [
        f"Mean loss over {learning.held_out_batches_per_rank} held-out batches per rank "
        "(never trained on), at each evaluation step.",
        "",
    ]
    lines += table(
        ["step", *(f"`{arm}`" for arm in series)],
        [
            (step, *("—" if values.get(step) is None else format_sig(values[step], 5)
                     for values in series.values()))
            for step in learning.eval_steps
        ],
    )  # fmt: skip
    if learning.rule == "non-inferiority":
        return lines + _horizon_lines(record)
    numbers = learning_margin(record)
    if numbers["margin"] is not None:
        calibration = learning.calibration_arm
        lines += [
            f"Margin {format_sig(numbers['margin'], 4)} = max({numbers['margin_factor']:g} × "
            f"the `{calibration}` arm's largest gap "
            f"{'—' if numbers['noise_gap'] is None else format_sig(numbers['noise_gap'], 3)}, "
            f"{numbers['margin_floor']:.0%} of the reference's held-out drop "
            f"{format_sig(numbers['reference_drop'], 4)}); the calibration arm is the "
            "reference with uniform noise of ±scale/2 per group "
            f"(G = {learning.calibration_group_size}) added to its working weights after "
            "every step ([Note: learning margin], qwz/qualify/evidence/rules/learning.py).",
            "",
        ]
    return lines


def _horizon_lines(record: Record) -> list[str]:
    """The long preset's rule ([Note: non-inferiority over the horizon],
    qwz/qualify/evidence/rules/horizon.py), candidate by candidate."""
    lines = [
        "Judged by a non-inferiority bound over the last half of the horizon: per held-out "
        "batch, the candidate's loss minus the reference's averaged over the window; the "
        "one-sided upper bound of their mean must lie within the margin calibrated by the "
        f"`{record.learning.calibration_arm}` arm over the same window ([Note: "
        "non-inferiority over the horizon], qwz/qualify/evidence/rules/horizon.py).",
        "",
    ]
    for check in record.checks:
        if check.name.startswith("learning[") and "upper" in check.numbers:
            lines += [f"- `{check.name}` **{check.status}**: {check.detail}", ""]
    return lines


def _performance_section(record: Record) -> list[str]:
    lines = ["## Performance", ""]
    if not record.performance:
        return [*lines, "No performance blocks in this record.", ""]
    reference = reference_arm(record)
    reference_name = reference.name if reference else "reference"
    for performance in record.performance:
        lines += [
            f"### `{performance.arm}` vs `{reference_name}`",
            "",
            f"{len(performance.blocks)} blocks; in each, every arm runs "
            f"{performance.warmup_steps} untimed warm-up steps, then {performance.block_steps} "
            f"timed steps (A = `{reference_name}`, B = `{performance.arm}`). "
            "Step times are the block medians.",
            "",
        ]
        lines += table(
            ["block", "order", "reference ms/step", "candidate ms/step", "speed-up"],
            [
                (
                    block.index,
                    block.order,
                    format_sig(block.reference_step_s * 1e3),
                    format_sig(block.candidate_step_s * 1e3),
                    format_speedup(block.speedup),
                )
                for block in performance.blocks
            ],
        )
        if performance.median_speedup is None:
            lines += [f"**Insufficient blocks** for an interval ({performance.ci_method}).", ""]
        else:
            lines += [
                f"**Median speed-up {format_speedup(performance.median_speedup)} "
                f"{format_interval(performance.ci_low, performance.ci_high)}** "
                f"({performance.ci_method}); p = {format_p(performance.p_value)}: "
                f"{performance.test}.",
                "",
            ]
        lines += report_sections.gather_lines(record, performance)
    return lines
