"""Report sections a reviewer acts on: where it ran, how to reproduce it, the gather's time.

Each function returns markdown lines for ``report.render_markdown``, read from the record
alone.
"""

from __future__ import annotations

import shlex

from qwz.qualify.evidence.schema import Record

GIB = 1024**3
VECTOR_FLAGS = ("avx2", "avx512f", "sve", "asimd")
"""Vector extensions the report names besides the numeric ones (provenance.py)."""


def machine_rows(record: Record) -> list[tuple[str, str]]:
    """Environment rows of [Note: where it ran] (qualify/evidence/machine.py) and the GPU stack,
    each only where the record has it (older records lack them)."""
    from qwz.qualify.evidence.provenance import NUMERIC_CPU_FLAGS

    environment = record.environment
    rows = []
    if environment.cpu_model:
        rows.append(("CPU", environment.cpu_model))
    if environment.cpu_flags:
        numeric = [flag for flag in NUMERIC_CPU_FLAGS if flag in environment.cpu_flags]
        vector = [flag for flag in VECTOR_FLAGS if flag in environment.cpu_flags]
        named = ", ".join(vector + numeric) or "none of note"
        rows.append(("CPU flags", f"{len(environment.cpu_flags)} flags; {named}"))
    memory = [value for value in environment.device_memory_bytes if value is not None]
    if memory:
        distinct = sorted({f"{value / GIB:.1f} GiB" for value in memory})
        rows.append(("memory per device", f"{', '.join(distinct)} ({len(memory)} ranks)"))
    if environment.host_count is not None:
        digest = (environment.hosts_sha256 or "")[:12]
        rows.append(("hosts", f"{environment.host_count}, names' sha256 `{digest}`"))
    for label, value in (
        ("CUDA", environment.cuda),
        ("cuDNN", environment.cudnn),
        ("NCCL", environment.nccl),
        ("NVIDIA driver", environment.driver),
        ("compute capabilities", ", ".join(sorted(set(environment.compute_capabilities)))),
    ):
        if value:
            rows.append((label, value))
    return rows


def reproduce_section(record: Record) -> list[str]:
    """[Note: reproduce]: the head to check out, the variables and the command line."""
    invocation = record.invocation
    lines = ["## Reproduce", ""]
    if invocation is None:
        return [*lines, "This record predates the recorded command line.", ""]
    variables = [f"{name}={shlex.quote(value)}" for name, value in invocation.environment.items()]
    command = " ".join(["qwz-qualify", *map(shlex.quote, invocation.argv)])
    checkout = f"git checkout {record.head.sha}"
    if record.head.dirty:
        checkout += "  # the run had uncommitted changes: this is not the exact code"
    lines += [
        f"On {record.environment.world_size} ranks of {record.environment.host_count or '?'} "
        "host(s) like the environment above, from a checkout of the head:",
        "",
        "```sh",
        checkout,
        *(f"export {variable}" for variable in variables),
        command,
        "```",
        "",
    ]
    return lines


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.4g}"


def gather_lines(record: Record, performance) -> list[str]:
    """The weight gather's own time per block next to the step's, and its speed-up
    with its interval ([Note: gather phase timing], qualify/run/gather_timing.py)."""
    if performance.gather_interval == "not measured":
        return [
            "Weight gather: not measured (the subject's gather did not pass through the "
            "seam the harness times, or the record predates gather timing).",
            "",
        ]
    rows = [
        f"| {block.index} | {_ms(block.reference_gather_step_s)} | "
        f"{_ms(block.candidate_gather_step_s)} | "
        + ("—" if block.gather_speedup is None else f"{block.gather_speedup:.3f}x")
        + " |"
        for block in performance.blocks
    ]
    lines = [
        "Weight gather alone (the same timed steps, block medians):",
        "",
        "| block | reference gather ms/step | candidate gather ms/step | gather speed-up |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    if performance.gather_median_speedup is None:
        lines += [f"**Gather speed-up:** {performance.gather_interval} for an interval.", ""]
    else:
        step = (
            "not measured"
            if performance.median_speedup is None
            else f"{performance.median_speedup:.3f}x "
            f"[{performance.ci_low:.3f}, {performance.ci_high:.3f}]"
        )
        lines += [
            f"**Gather speed-up {performance.gather_median_speedup:.3f}x "
            f"[{performance.gather_ci_low:.3f}, {performance.gather_ci_high:.3f}]** "
            f"(percentile bootstrap of the median over blocks), next to the step's {step}.",
            "",
        ]
    return lines


def scheme_lines(record: Record) -> list[str]:
    """The report's first page: which scheme of the contract the subject wrote, what it cost
    on this run, and the loss gap of the arm the cost is of against its margin ([Note: what a
    scheme costs], qualify/run/observers/scheme_cost.py); none where nothing was quantized."""
    from qwz.qualify.evidence.rules.schemes import scheme_report

    report = scheme_report(record)
    if report.arm is None and report.scheme is None and not report.mixed:
        return []
    learning = next(
        (check for check in record.checks if check.name == f"learning[{report.arm}]"), None
    )
    gap = None
    if learning is not None and {"worst_gap", "margin"} <= learning.numbers.keys():
        gap = (
            f"on this workload `{report.arm}`'s held-out loss gap is "
            f"{learning.numbers['worst_gap']:+.4g} against a margin of "
            f"{learning.numbers['margin']:.4g}"
        )
    sentence = report.sentence(gap)
    return [f"**Scheme.** {sentence[:1].upper()}{sentence[1:]}.", ""]
