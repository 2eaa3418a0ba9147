"""``qwz-qualify run --ds-config FILE`` ([Note: the user's DeepSpeed config],
qwz/qualify/request/ds_config.py): the file is the base of every arm, contradictions are refused
before any rank starts naming the key, and the record's plan keeps the file and its digest.

No training here: flags go through ``build_parser``, ``run_request.resolve`` and
``preflight.problems`` (the ``mlp`` workload, counted on the meta device); the runs are in
tests/multigpu/test_qualify_ds_config.py.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from qwz.qualify import cli
from qwz.qualify.base.plan import DeepSpeedConfigFile, RunPlan, plan_dict
from qwz.qualify.evidence import schema
from qwz.qualify.matrix import matrix_spec as matrix_spec
from qwz.qualify.run import launch
from tests.unit.run_requests import plan_of, problems_of

PR_CONFIG = {
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 2e-4, "betas": [0.9, 0.95], "torch_adam": True, "weight_decay": 0.05},
    },
    "zero_optimization": {"reduce_bucket_size": 1e8, "overlap_comm": False},
    "gradient_clipping": 0,
    "steps_per_print": 1000,
}
"""DeepSpeed's Adam (torch's implementation, decoupled), a 100M reduce bucket, no clipping."""


def write(tmp_path: pathlib.Path, content, name: str = "ds.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def parse(tmp_path: pathlib.Path, *argv: str):
    return cli.build_parser().parse_args(
        ["run", "--workload", "mlp", "--out", str(tmp_path / "out"), *argv]
    )


def plan(tmp_path: pathlib.Path, content, *argv: str) -> RunPlan:
    return plan_of(parse(tmp_path, "--ds-config", str(write(tmp_path, content)), *argv))


def refusals(tmp_path: pathlib.Path, content, *argv: str) -> list[str]:
    path = write(tmp_path, content)
    return problems_of(parse(tmp_path, "--ds-config", str(path), *argv))


# --------------------------------------------------------------------------- the arms


@pytest.mark.parametrize("subject", ["qwz", "deepspeed", "deepspeed-native"])
def test_every_arm_carries_exactly_the_file_s_optimizer_buckets_and_clipping(tmp_path, subject):
    planned = plan(tmp_path, PR_CONFIG, "--subject", subject, "--group-size", "64")
    configs = {arm.name: planned.arm_config(arm) for arm in planned.arms}
    assert list(configs) == [
        "reference",
        "calibration-g64",
        "candidate-g64",
        "candidate-g64-chunked",
    ]
    # The chunked arm is the candidate with its own bucket ([Note: the chunked arm]).
    chunked = configs.pop("candidate-g64-chunked")
    bucket = chunked["zero_optimization"].pop("allgather_bucket_size")
    assert bucket == planned.chunked_allgather_bucket_size and chunked == configs["candidate-g64"]
    for config in configs.values():
        assert config["optimizer"] == PR_CONFIG["optimizer"]
        assert config["zero_optimization"]["reduce_bucket_size"] == 1e8
        assert "allgather_bucket_size" not in config["zero_optimization"]  # DeepSpeed's default
        assert config["gradient_clipping"] == 0 and config["steps_per_print"] == 1000
        assert config["zero_optimization"]["overlap_comm"] is False
        # What the harness sets over the file: the stage, the dtype, the batch.
        assert config["zero_optimization"]["stage"] == 2 and config["bf16"] == {"enabled": True}
        assert (
            config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"],
        ) == (
            8,
            1,
        )
    # The arms differ only in what the harness varies ([Note: the user's DeepSpeed config]).
    reference, calibration, candidate = configs.values()
    assert (
        calibration == reference
        and reference["zero_optimization"]["zero_quantized_weights"] is False
    )
    candidate_zero = candidate["zero_optimization"]
    assert candidate_zero.pop("zero_quantized_weights") is True
    assert candidate_zero.pop("zero_quantized_weights_group_size", 64) == 64
    reference["zero_optimization"].pop("zero_quantized_weights")
    assert candidate == reference


def test_only_in_the_file_the_file_s_value_wins_and_the_plan_records_it(tmp_path):
    content = {
        "zero_optimization": {"stage": 1, "allgather_bucket_size": 2e8},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    }
    planned = plan(tmp_path, content)
    assert (planned.stage, planned.dtype, planned.allgather_bucket_size) == (1, "fp32", 200_000_000)
    # What the file leaves out is DeepSpeed's default, as DeepSpeed reads the file: no
    # clipping, a 5e8 reduce bucket, FusedAdam (torch_adam false) with weight decay 0.
    assert (planned.gradient_clipping, planned.reduce_bucket_size) == (0.0, 500_000_000)
    assert (planned.lr, planned.weight_decay, planned.torch_adam) == (3e-4, 0.0, False)
    assert "gradient_clipping" not in planned.arm_config(planned.arms[0])


def test_a_flag_the_file_leaves_out_is_set_in_every_arm(tmp_path):
    planned = plan(tmp_path, PR_CONFIG, "--allgather-bucket-size", "65536", "--stage", "1")
    for arm in planned.arms:
        zero = planned.arm_config(arm)["zero_optimization"]
        bucket = arm.allgather_bucket_size or 65536  # the chunked arm keeps its own
        assert (zero["allgather_bucket_size"], zero["stage"]) == (bucket, 1)
    assert planned.ds_config.from_flags == {"zero_optimization.allgather_bucket_size": 65536}


def test_a_file_without_an_optimizer_gets_the_harness_s_adamw(tmp_path):
    planned = plan(tmp_path, {"gradient_clipping": 0.5}, "--lr", "2e-3")
    optimizer = planned.arm_config(planned.arms[0])["optimizer"]
    assert optimizer == {
        "type": "AdamW",
        "params": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
    }
    assert planned.gradient_clipping == 0.5


def test_an_fp16_file_keeps_its_loss_scaling_and_the_run_fills_none_of_it(tmp_path):
    content = {"fp16": {"enabled": True, "initial_scale_power": 12}}
    planned = plan(tmp_path, content)
    assert planned.dtype == "fp16" and planned.fp16_initial_scale_power == 12
    assert planned.fp16_loss_scale_window == 1000  # DeepSpeed's default: the file's meaning
    config = planned.arm_config(planned.arms[0])
    assert config["fp16"] == {"enabled": True, "initial_scale_power": 12}
    assert config["bf16"] == {"enabled": False}


# --------------------------------------------------------------------------- the record


def test_the_plan_keeps_the_file_its_digest_and_its_content(tmp_path):
    text = json.dumps(PR_CONFIG, indent=1) + "\n"
    path = write(tmp_path, text)
    planned = plan_of(parse(tmp_path, "--ds-config", str(path)))
    recorded = json.loads(json.dumps(plan_dict(planned)))
    assert recorded["ds_config"] == {
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "content": PR_CONFIG,
        "from_flags": {},
    }
    typed = schema.Plan.model_validate(recorded)
    assert typed.ds_config.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert recorded["reduce_bucket_size"] == 100_000_000 and recorded["torch_adam"] is True


def test_without_a_file_the_arms_are_the_harness_s_own(tmp_path):
    planned = plan_of(parse(tmp_path, "--subject", "deepspeed"))
    assert planned.ds_config is None and plan_dict(planned)["ds_config"] is None
    config = planned.arm_config(planned.arms[0])
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["gradient_clipping"] == 1.0


# --------------------------------------------------------------------------- refusals


REFUSED = [
    (
        {"zero_optimization": {"zero_quantized_weights": True}},
        (),
        "zero_optimization.zero_quantized_weights is true in the file; the reference arm needs "
        "false (the harness sets it per arm: leave it out)",
    ),
    (
        {"zero_optimization": {"zero_quantized_weights": False}},
        (),
        "zero_optimization.zero_quantized_weights is false in the file; the candidate-g64 arm "
        "needs true",
    ),
    (
        {"zero_optimization": {"zero_quantized_weights_group_size": 64}},
        (),
        "zero_optimization.zero_quantized_weights_group_size is 64 in the file; the reference "
        "arm sets none and each candidate its own group size",
    ),
    (
        {"zero_optimization": {"stage": 1}},
        ("--stage", "2"),
        "zero_optimization.stage is 1 in the file; --stage 2 was given",
    ),
    (
        {"zero_optimization": {"stage": 3}},
        (),
        "zero_optimization.stage is 3 in the file; the run qualifies ZeRO stage 1 or 2",
    ),
    (
        {"bf16": {"enabled": True}},
        ("--dtype", "fp32"),
        "bf16.enabled is true in the file (dtype bf16); --dtype fp32 was given",
    ),
    ({"bf16": {"enabled": "auto"}}, (), "bf16.enabled is 'auto' in the file; must be true or"),
    ({"bfloat16": {"enabled": True}}, (), "bfloat16 is in the file: write it as bf16"),
    (
        {"zero_optimization": {"reduce_bucket_size": 1e8}},
        ("--reduce-bucket-size", "500000000"),
        "zero_optimization.reduce_bucket_size is 100000000 in the file; --reduce-bucket-size "
        "500000000 was given",
    ),
    (
        {"gradient_clipping": 0},
        ("--gradient-clipping", "1.0"),
        "gradient_clipping is 0.0 in the file; --gradient-clipping 1.0 was given",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
        ("--lr", "1e-3"),
        "optimizer.params.lr is 0.0001 in the file; --lr 0.001 was given",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},
        ("--torch-adam",),
        "optimizer.params.torch_adam is false in the file; --torch-adam was given",
    ),
    (
        {"zero_optimization": {"reduce_bucket_size": -1}},
        (),
        "zero_optimization.reduce_bucket_size in the file: -1 is invalid: must be a positive",
    ),
    (
        {"train_micro_batch_size_per_gpu": 4},
        (),
        "train_micro_batch_size_per_gpu is 4 in the file; the run needs 8 (the workload's "
        "micro-batch)",
    ),
    (
        {"gradient_accumulation_steps": 2},
        (),
        "gradient_accumulation_steps is 2 in the file; the run needs 1",
    ),
    (
        {"train_batch_size": 8},
        (),
        "train_batch_size is 8 in the file; the run needs 16 (micro-batch 8 x 2 ranks)",
    ),
    ([1, 2], (), "holds a JSON list, not an object"),
    ({"zero_optimization": [1]}, (), "zero_optimization is [1]; must be a JSON object"),
    ('{"optimizer": {"type": "AdamW",}}', (), "not valid JSON"),
    ('{"gradient_clipping": 1, "gradient_clipping": 2}', (), "duplicate key"),
]


@pytest.mark.parametrize(("content", "argv", "message"), REFUSED)
def test_a_file_that_contradicts_an_arm_or_a_flag_is_refused_naming_the_key(
    tmp_path, content, argv, message
):
    problems = refusals(tmp_path, content, "--group-size", "64", *argv)
    path = tmp_path / "ds.json"
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"--ds-config {path}: ") and message in problems[0], problems


def test_a_missing_file_is_refused_naming_it(tmp_path):
    problems = problems_of(parse(tmp_path, "--ds-config", str(tmp_path / "no")))
    assert problems == [
        f"--ds-config {tmp_path / 'no'}: cannot read DeepSpeed config: No such file or directory"
    ]


def test_cmd_run_refuses_a_contradicting_file_with_exit_2_and_one_line(
    tmp_path, monkeypatch, capsys
):
    def must_not_launch(*args, **kwargs):
        raise AssertionError("launched although the request was refused")

    monkeypatch.setattr(launch, "launch", must_not_launch)
    path = write(tmp_path, {"zero_optimization": {"zero_quantized_weights": True, "stage": 2}})
    code = cli.main(["run", "--workload", "mlp", "--ds-config", str(path), "--out", str(tmp_path)])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"qwz-qualify run: error: --ds-config {path}: zero_optimization.zero_quantized_weights "
        "is true in the file; the reference arm needs false (the harness sets it per arm: "
        "leave it out)"
    )


def test_qwz_s_strict_config_refuses_what_its_engine_does_not_implement(tmp_path):
    content = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    [problem] = refusals(tmp_path, content, "--subject", "qwz")
    assert problem.startswith(f"--ds-config {(tmp_path / 'ds.json').resolve()}: qwz's config")
    assert "zero_optimization.offload_optimizer" in problem


def test_an_accepted_file_passes_the_preflight(tmp_path):
    assert refusals(tmp_path, PR_CONFIG, "--subject", "qwz") == []


# --------------------------------------------------------------------------- a matrix cell


def test_a_matrix_cell_passes_the_file_relative_to_its_spec(tmp_path):
    write(tmp_path, PR_CONFIG, "pr.json")
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(
        '[matrix]\nname = "m"\n[[cells]]\nname = "c"\nworkload = "mlp"\nds_config = "pr.json"\n'
    )
    [cell] = matrix_spec.load(spec_path).cells
    arguments = cell.run_arguments()
    at = arguments.index("--ds-config")
    assert arguments[at + 1] == str(tmp_path / "pr.json")


def test_the_arm_config_without_the_file_is_unchanged_by_the_merge():
    """The merge reads the harness's config and never changes it (each arm builds its own)."""
    loaded = DeepSpeedConfigFile("f", "0" * 64, {"gradient_clipping": 0})
    harness = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "zero_quantized_weights": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    before = json.dumps(harness, sort_keys=True)
    merged = loaded.arm_config(harness)
    merged["optimizer"]["params"]["lr"] = 5.0
    assert json.dumps(harness, sort_keys=True) == before
    assert loaded.content == {"gradient_clipping": 0}


def test_the_report_names_the_file_its_digest_and_the_keys_set_from_flags():
    from qwz.qualify.review import report
    from tests.unit.records import make_payload, make_record

    ds_file = {
        "path": "/configs/ds.json",
        "sha256": "ab" * 32,
        "content": PR_CONFIG,
        "from_flags": {"zero_optimization.allgather_bucket_size": 65536},
    }
    record = make_record(plan=dict(make_payload()["plan"], ds_config=ds_file))
    markdown = report.render_markdown(record)
    assert "built on the DeepSpeed config `/configs/ds.json` (sha256 `abababababababab`)" in (
        markdown
    )
    assert "from flags `zero_optimization.allgather_bucket_size`" in markdown
    assert "DeepSpeed config" not in report.render_markdown(make_record())
