"""Issue 17, items 1-5: nothing lost after a run started, nothing vacuous passes, the
report a reviewer reads, where it ran, and CI conventions (JUnit, job summaries).

No training here except the gather-timing seam, which steps one single-rank qwz arm.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

from qwz.qualify import cli
from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import gather_speed, machine, record
from qwz.qualify.evidence.rules import speed
from qwz.qualify.evidence.schema import Record
from qwz.qualify.evidence.seal import seal
from qwz.qualify.request import requirements
from qwz.qualify.review import banner, history, junit, outputs, plots, report
from qwz.qualify.run import gather_timing, timing
from qwz.qualify.run.subjects import make_arm
from qwz.qualify.run.workloads import get_workload
from tests.unit.records import CANDIDATE, _blocks, make_payload, make_performance, make_record
from tests.unit.run_requests import problems_of

REPO = pathlib.Path(__file__).parents[4]


def run_blocked(module: str, *argv: str) -> subprocess.CompletedProcess:
    """``qwz-qualify`` in a subprocess where `module` cannot be imported."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from qwz.qualify.cli import main\n"
        f"sys.exit(main({list(argv)!r}))"
    )
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


# --------------------------------------------------------- 1. nothing lost after a start


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        ("matplotlib", ["--workload", "mlp"], "qualify"),
        ("transformers", ["--workload", "qwen3-tiny"], "qualify"),
        ("scipy", ["--workload", "mlp"], "qualify"),
        ("deepspeed", ["--workload", "mlp", "--subject", "deepspeed"], "deepspeed"),
    ],
)
def test_a_missing_optional_package_is_refused_before_any_rank(tmp_path, module, argv, extra):
    done = run_blocked(module, "run", "--out", str(tmp_path / "out"), *argv)
    assert done.returncode == 2, done.stderr
    assert f"{module} is not installed" in done.stderr
    assert f"pip install 'qwz[{extra}]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_only_the_packages_a_run_imports_are_needed():
    wanted = requirements.needed(workload="mlp", subject="qwz", blocks=3)
    assert [module for module, _, _ in wanted] == ["matplotlib"]  # no p-value below 4 blocks
    wanted = requirements.needed(workload="qwen3-tiny", subject="deepspeed-native", blocks=4)
    assert [module for module, _, _ in wanted] == [
        "matplotlib",
        "scipy",
        "transformers",
        "deepspeed",
    ]


def test_a_plot_that_fails_costs_neither_the_record_nor_the_report(tmp_path, monkeypatch):
    built = make_record()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    drawn = outputs.write_run_outputs(built, tmp_path, None, "\n## Signature\n")
    assert drawn.plots == {} and "import of matplotlib" in drawn.problem
    assert record.load(tmp_path / "record.json").digest == built.digest
    text = (tmp_path / "report.md").read_text()
    assert "## Plots\n\nNot drawn: ModuleNotFoundError: import of" in text and text.endswith(
        "## Signature\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["record.json", "report.md"]


def test_plots_that_draw_are_moved_in_together(tmp_path):
    drawn = outputs.write_run_outputs(make_record(), tmp_path, None, "")
    assert drawn.problem is None
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == sorted(["record.json", "report.md", *drawn.plots.values()])
    assert "Not drawn" not in (tmp_path / "report.md").read_text()


# --------------------------------------------------------- 2. nothing vacuous passes


def test_the_smallest_sensible_bucket_size_is_the_boundary(tmp_path):
    def problems(bucket: int) -> list[str]:
        flag = "--allgather-bucket-size"
        argv = ["run", "--out", str(tmp_path / "o"), "--workload", "mlp", flag, str(bucket)]
        args = cli.build_parser().parse_args(argv)
        return [line for line in problems_of(args) if flag in line]

    (refusal,) = problems(7)
    assert "269,091 collectives per step" in refusal and refusal.endswith("use at least 264")
    assert problems(264) == []
    assert len(problems(263)) == 1
    shard = -(-538_182 // 2)
    assert requirements.gather_collectives_per_step(shard, 2, 264) <= 4096
    assert requirements.gather_collectives_per_step(shard, 2, 263) > 4096


def test_one_rank_gathers_nothing_so_no_bucket_is_refused():
    assert requirements.bucket_size_problems(10**6, 1, 7) == []


def three_block_record() -> Record:
    performance = make_performance()
    performance.update(speed.summarize_blocks(_blocks()[:3]))
    return make_record(performance=[performance])


def inconclusive_record() -> Record:
    payload = make_payload(environment={"world_size": 1, "device_names": ["NVIDIA H200"]})
    for hashes in payload["hashes"]:
        hashes["per_rank"] = hashes["per_rank"][:1]
    payload["probes"][0] |= {
        "reported_group_sizes": [None],
        "gather_bytes_per_step": 0,
        "reference_gather_bytes_per_step": 0,
    }
    return make_record(**payload)


@pytest.mark.parametrize(
    ("built", "message"),
    [
        (three_block_record, "needs a speed-up interval for every candidate"),
        (lambda: make_record(performance=[]), "no speed blocks"),
        (inconclusive_record, "verdict INCONCLUSIVE: in-effect"),
    ],
)
def test_promote_refuses_what_would_switch_the_gate_off(tmp_path, capsys, built, message):
    source = tmp_path / "night" / "record.json"
    source.parent.mkdir()
    record.save(built(), source)
    assert cli.main(["promote", str(source), str(tmp_path / "baseline")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "baseline" / "record.json").exists()


def test_history_handles_every_valid_record(tmp_path, capsys):
    same_day = [
        make_record(created_at="2025-06-02T01:00:00+00:00"),
        make_record(created_at="2025-06-02T13:00:00+00:00"),
    ]
    for index, built in enumerate([*same_day, three_block_record(), inconclusive_record()]):
        stamp = f"2025-06-02T13:00:0{index}+00:00"  # the last three: one minute, one head
        built = seal(built.model_dump(mode="json") | {"created_at": stamp})
        path = tmp_path / "nights" / str(index) / "record.json"
        path.parent.mkdir(parents=True)
        record.save(built, path)
    assert cli.main(["history", str(tmp_path / "nights"), "--out", str(tmp_path / "h")]) == 0
    text = capsys.readouterr().out
    assert "| not measured (3 blocks) | — |" in text
    assert "| INCONCLUSIVE |" in text
    nights, _ = history.collect(tmp_path / "nights")
    labels = [night.label for night in nights]
    assert len(set(labels)) == len(labels) == 4  # one x position per record
    assert (tmp_path / "h" / "history.png").is_file()


# --------------------------------------------------------- 3. the report a reviewer reads


def test_the_banner_says_correctness_and_speed_apart():
    passing = make_record()
    performance = passing.performance[0]
    assert banner.banner(passing) == (
        f"PASS; speed {performance.median_speedup:.3f}x "
        f"[{performance.ci_low:.3f}, {performance.ci_high:.3f}]"
    )
    assert banner.banner(three_block_record()) == "PASS; speed: not measured (3 blocks)"
    assert banner.banner(inconclusive_record()).startswith(
        f"INCONCLUSIVE (in-effect[{CANDIDATE}], bounded[{CANDIDATE}]); speed "
    )
    markdown = report.render_markdown(inconclusive_record())
    assert (
        f"**Inconclusive:** `in-effect[{CANDIDATE}]`, `bounded[{CANDIDATE}]`: one rank: nothing "
        "was quantized" in (markdown.split("## ")[0])
    )


def with_gather_times(reference_s: float, candidate_s: float) -> list[dict]:
    blocks = _blocks()
    for block in blocks:
        steps = len(block["reference_times_s"])
        block["reference_gather_s"] = [reference_s * (1 + 0.01 * i) for i in range(steps)]
        block["candidate_gather_s"] = [candidate_s * (1 + 0.01 * i) for i in range(steps)]
    return blocks


def test_the_gather_speedup_is_derived_with_its_interval_and_reported():
    performance = make_performance()
    performance.update(speed.summarize_blocks(with_gather_times(0.004, 0.0025)))
    built = make_record(performance=[performance])
    loaded = built.performance[0]
    assert loaded.gather_interval == "bootstrap"
    assert loaded.gather_median_speedup == pytest.approx(1.6)
    assert loaded.gather_ci_low <= 1.6 <= loaded.gather_ci_high
    assert "; gather 1.600x [" in banner.banner(built)
    markdown = report.render_markdown(built)
    assert "| 0 | 4.08 | 2.55 | 1.600x |" in markdown
    assert "**Gather speed-up 1.600x [" in markdown and "next to the step's" in markdown


def test_a_record_without_gather_times_loads_as_written(tmp_path):
    built = make_record()  # the raw blocks of a record written before gather timing
    assert built.performance[0].gather_interval == gather_speed.NOT_MEASURED
    record.save(built, tmp_path / "record.json")
    assert record.load(tmp_path / "record.json") == built
    assert "Weight gather: not measured" in report.render_markdown(built)


def test_measure_blocks_keeps_each_timed_steps_reading():
    readings = iter(range(100))

    def step():
        value = next(readings)
        return lambda: value * 1e-3

    blocks = timing.measure_blocks(step, lambda: None, blocks=2, block_steps=2, warmup_steps=1)
    assert blocks[0].reference_gather_times == [1e-3, 2e-3]  # the warm-up's 0 is not kept
    assert blocks[0].candidate_gather_times == [None, None]
    assert blocks[1].reference_gather_times == [4e-3, 5e-3]


def test_the_gather_of_a_qwz_arm_is_timed_through_its_optimizer():
    plan = RunPlan(workload=get_workload("mlp"), dtype="bf16")
    arm = plan.arms[-1]
    model = plan.workload.build_model(0, dtype=torch.bfloat16)
    engine = make_arm("qwz", model, plan.arm_config(arm), quantized=True)
    batch = plan.workload.batch(seed=0, step=1, rank=0)
    with gather_timing.timed_gather(engine) as clock:
        engine.train_step(plan.workload.loss(engine.module, batch))
    seconds = clock.read()
    assert clock.calls == 1 and seconds is not None and seconds > 0
    assert "gather_weights" not in vars(engine.optimizer)  # the wrapper is gone
    with gather_timing.timed_gather(engine) as clock:
        pass  # a step that never gathered
    assert clock.read() is None


def test_the_report_has_the_held_out_plot_and_a_reproduce_block(tmp_path):
    invocation = machine.invocation(
        ["run", "--out", "runs/x", "--workload", "mlp"],
        {"QWZ_BACKEND": "gloo", "QWZ_RECORD_KEY": "secret", "NCCL_DEBUG": "INFO", "HOME": "/h"},
    )
    built = make_record(invocation=invocation)
    markdown = report.render_markdown(built)
    reproduce = markdown.split("## Reproduce")[1].split("## Checks")[0]
    assert "export NCCL_DEBUG=INFO\nexport QWZ_BACKEND=gloo\n" in reproduce
    assert "qwz-qualify run --out runs/x --workload mlp\n" in reproduce
    assert "secret" not in json.dumps(built.model_dump()) and "HOME" not in reproduce
    written = plots.write_plots(built, tmp_path)
    assert written["held_out"] == "held_out.png" and written["step_times"] == "step_times.png"


# --------------------------------------------------------- 4. where it ran


def test_the_environment_says_where_it_ran():
    machines = [
        {"hostname": name, "cpu_model": "EPYC", "cpu_flags": ["avx2"], "device_memory_bytes": 8}
        for name in ("b", "a", "b")
    ]
    fields = machine.environment_fields(machines)
    assert fields["host_count"] == 2 and fields["device_memory_bytes"] == [8, 8, 8]
    assert fields["hosts_sha256"] == machine.hashlib.sha256(b"a\nb").hexdigest()
    built = make_record(environment=fields)
    plain = make_record()
    assert built.environment.fingerprint() == plain.environment.fingerprint()
    markdown = report.render_markdown(built)
    assert "| CPU | EPYC |" in markdown and "| hosts | 2, names' sha256 " in markdown
    here = machine.rank_machine()
    assert here["hostname"] and isinstance(here["cpu_flags"], list)


# --------------------------------------------------------- 5. CI conventions


def parsed(text: str) -> ElementTree.Element:
    root = ElementTree.fromstring(text.encode())
    assert root.tag == "testsuites"
    return root


def test_junit_has_one_test_case_per_check_with_the_right_counts():
    payload = make_payload()
    payload["updates"][2]["violations"] = 4  # the candidate's update check fails
    failing = make_record(updates=payload["updates"])
    for built in (failing, inconclusive_record()):
        root = parsed(junit.record_junit(built))
        (suite,) = root.findall("testsuite")
        cases = suite.findall("testcase")
        assert [case.get("name") for case in cases] == [check.name for check in built.checks]
        statuses = [check.status for check in built.checks]
        for attribute, status in (
            ("failures", "fail"),
            ("skipped", "n/a"),
            ("errors", "inconclusive"),
        ):
            assert int(suite.get(attribute)) == statuses.count(status), attribute
            assert root.get(attribute) == suite.get(attribute)
        assert int(suite.get("tests")) == len(built.checks)
        for case, check in zip(cases, built.checks, strict=True):
            tag = junit.JUNIT_STATUS.get(check.status)
            if tag is not None:
                assert case.find(tag).get("message") == check.detail
    assert parsed(junit.record_junit(failing)).find("testsuite").get("failures") == "1"


def test_report_format_junit_and_the_run_job_summary(tmp_path, capsys, monkeypatch):
    path = tmp_path / "record.json"
    summary_file = tmp_path / "summary.md"
    summary_file.write_text("earlier step\n")
    monkeypatch.setenv(outputs.STEP_SUMMARY_ENV, str(summary_file))
    outputs.write_run_outputs(make_record(), tmp_path, None, "")
    assert summary_file.read_text().startswith("earlier step\n### qwz qualification: PASS; ")
    assert cli.main(["report", str(path), "--format", "junit"]) == 0
    assert parsed(capsys.readouterr().out).get("failures") == "0"


def test_compare_gate_as_junit_and_job_summary(tmp_path, capsys, monkeypatch):
    baseline, candidate = tmp_path / "baseline.json", tmp_path / "candidate.json"
    record.save(make_record(), baseline)
    record.save(make_record(performance=[make_performance(speed_scale=0.8)]), candidate)
    summary_file = tmp_path / "summary.md"
    monkeypatch.setenv(outputs.STEP_SUMMARY_ENV, str(summary_file))
    status = cli.main(["compare", str(baseline), str(candidate), "--format", "junit"])
    assert status == 1
    root = parsed(capsys.readouterr().out)
    assert root.get("tests") == "1" and root.get("failures") == "1"
    assert "REGRESSION: " in root.find("testsuite/testcase/failure").get("message")
    assert summary_file.read_text().startswith("### qwz-qualify compare: 1 regression")
    assert cli.main(["compare", str(baseline), str(baseline), "--format", "junit"]) == 0
    assert parsed(capsys.readouterr().out).get("failures") == "0"


def test_history_as_junit(tmp_path, capsys):
    for index, built in enumerate([make_record(), inconclusive_record()]):
        path = tmp_path / str(index) / "record.json"
        path.parent.mkdir()
        record.save(built, path)
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "record.json").write_text("{")
    assert cli.main(["history", str(tmp_path), "--format", "junit"]) == 2
    root = parsed(capsys.readouterr().out)
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("3", "0", "2")
