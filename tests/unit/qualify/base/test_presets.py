"""``qwz-qualify run --preset``: qualify/base/presets.py through the parser and the plan."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from qwz.qualify import cli
from qwz.qualify.base import presets
from qwz.qualify.base.plan import Launch, RunPlan
from qwz.qualify.base.values import POSITIVE_FINITE, setting
from qwz.qualify.matrix import matrix_spec as matrix_spec
from qwz.qualify.request import requirements, run_request, settings
from qwz.qualify.run.workloads import get_workload
from tests.extras import NEEDS_TRANSFORMERS
from tests.unit.run_requests import plan_of, problems_of


def plan(*argv: str) -> RunPlan:
    return plan_of(cli.build_parser().parse_args(["run", "--out", "x", *argv]))


@NEEDS_TRANSFORMERS
def test_the_default_preset_is_the_twenty_step_qualification_unchanged():
    planned = plan()
    assert (planned.workload, planned.steps, planned.eval_every) == (
        get_workload("qwen3-tiny"),
        20,
        5,
    )
    assert (planned.blocks, planned.held_out_batches) == (4, 2)
    assert (planned.preset, planned.learning_rule) == ("default", "max-gap")
    defaults = RunPlan(workload=get_workload("qwen3-tiny"))
    assert (planned.steps, planned.eval_every, planned.blocks, planned.held_out_batches) == (
        defaults.steps,
        defaults.eval_every,
        defaults.blocks,
        defaults.held_out_batches,
    )


def test_the_long_preset_fills_the_flags_left_unset(monkeypatch):
    monkeypatch.setattr(run_request, "_has_gpu_per_rank", lambda world_size: False)
    planned = plan("--preset", "long")
    assert planned.workload == get_workload("mlp-small") and planned.steps >= 2000
    assert (planned.eval_every, planned.blocks, planned.held_out_batches) == (20, 0, 8)
    assert (planned.preset, planned.learning_rule) == ("long", "non-inferiority")
    # A flag given wins: a shortened long run is still judged by the long rule.
    short = plan("--preset", "long", "--steps", "60", "--eval-every", "10", "--workload", "mlp")
    assert (short.steps, short.eval_every, short.workload.name) == (60, 10, "mlp")
    assert short.learning_rule == "non-inferiority"


@NEEDS_TRANSFORMERS
def test_the_long_preset_trains_qwen3_0_6b_where_every_rank_has_a_gpu(monkeypatch):
    monkeypatch.setattr(run_request, "_has_gpu_per_rank", lambda world_size: True)
    assert plan("--preset", "long").workload.name == "qwen3-0.6b"
    assert plan("--preset", "long", "--workload", "mlp-small").workload.name == "mlp-small"
    assert plan().workload.name == "qwen3-tiny"  # the default preset has no GPU choice


def test_an_unknown_preset_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["run", "--out", "x", "--preset", "longer"])
    assert exited.value.code == 2
    assert "'longer' is invalid: must be one of default, long" in capsys.readouterr().err


def test_the_long_rule_needs_scipy_even_without_speed_blocks():
    wanted = requirements.needed(
        workload="mlp-small", subject="qwz", blocks=0, learning_rule="non-inferiority"
    )
    assert requirements.HORIZON_STATISTICS in wanted and requirements.TRANSFORMERS not in wanted
    assert requirements.HORIZON_STATISTICS not in requirements.needed(
        workload="mlp-small", subject="qwz", blocks=0
    )


def test_every_preset_value_is_a_setting_its_rule_accepts():
    declared = settings.run_settings()
    for preset in presets.PRESETS.values():
        for name, value in {**preset.values, **preset.gpu_values}.items():
            assert name in declared, f"preset {preset.name}: {name} is no run setting"
            assert declared[name].check(value) == value


def test_the_check_above_catches_a_preset_value_its_rule_refuses():
    with pytest.raises(ValueError, match="must be a positive integer"):
        settings.run_settings()["steps"].check(0)


@dataclasses.dataclass(frozen=True)
class _Extended(RunPlan):
    """RunPlan with one setting more, declared as every setting is."""

    warmup_lr: float = setting(0.5, POSITIVE_FINITE, "a setting this test adds")


def test_a_setting_declared_once_reaches_the_flags_the_matrix_and_the_presets(monkeypatch):
    """[Note: one declaration per setting]: one field, and ``run --help`` lists its flag,
    the matrix spec accepts its key and passes it on, and a preset may set it."""
    monkeypatch.setattr(settings, "run_settings", lambda: settings.declared_in((_Extended, Launch)))
    parser = cli.build_parser()
    run_help = parser._subparsers._group_actions[0].choices["run"].format_help()
    assert "--warmup-lr X" in run_help and "a setting this test adds (default: 0.5)" in run_help
    spec = matrix_spec.parse(
        '[matrix]\nname = "m"\n[[cells]]\nname = "g"\nwarmup_lr = 0.25\n', pathlib.Path("m")
    )
    assert spec.cells[0].run_arguments()[-2:] == ["--warmup-lr", "0.25"]
    with pytest.raises(matrix_spec.SpecError, match="warmup_lr: -1 is invalid"):
        matrix_spec.parse(
            '[matrix]\nname = "m"\n[[cells]]\nname = "g"\nwarmup_lr = -1\n', pathlib.Path("m")
        )
    tuned = presets.Preset("tuned", values={"workload": "mlp", "warmup_lr": 0.75})
    monkeypatch.setitem(presets.PRESETS, "tuned", tuned)
    args = parser.parse_args(["run", "--out", "x"])
    args.preset = "tuned"
    assert run_request.preset_values(args)["warmup_lr"] == 0.75
    given = parser.parse_args(["run", "--out", "x", "--warmup-lr", "2"])
    given.preset = "tuned"
    assert run_request.preset_values(given)["warmup_lr"] == 2.0
    assert set(run_request.given_settings(given)) == {"warmup_lr", "preset"}


# --------------------------------------------------------------------------- pr-evidence


@NEEDS_TRANSFORMERS
def test_the_pr_evidence_preset_resolves_to_the_pr_s_settings(monkeypatch):
    """[Note: the PR's evidence]: Qwen3-4B at 2048, bf16, ZeRO-2, a rank per local GPU, 20
    steps, four blocks, G 64 and 8192, a 100M reduce bucket, fused AdamW, SDPA."""
    monkeypatch.setattr(run_request, "_local_gpu_count", lambda: 4)
    args = cli.build_parser().parse_args(["run", "--out", "x", "--preset", "pr-evidence"])
    request = run_request.resolve(args)
    planned = request.plan
    model = planned.workload.params["model"]
    assert planned.workload.name == "qwen3-4b" and planned.workload.params["attention"] == "sdpa"
    assert (model["num_hidden_layers"], model["hidden_size"]) == (36, 2560)
    assert (planned.workload.params["seq_len"], planned.workload.params["micro_batch"]) == (
        2048,
        1,
    )
    assert (planned.subject, planned.stage, planned.dtype) == ("deepspeed-native", 2, "bf16")
    assert (planned.group_sizes, planned.steps, planned.blocks) == ((64, 8192), 20, 4)
    assert request.world_size == 4
    for arm in planned.arms:
        config = planned.arm_config(arm)
        assert config["zero_optimization"]["reduce_bucket_size"] == 100_000_000
        assert config["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed's FusedAdam
        assert config["bf16"] == {"enabled": True} and config["zero_optimization"]["stage"] == 2
    # A world size given wins; without GPUs the declared default holds.
    given = cli.build_parser().parse_args(
        ["run", "--out", "x", "--preset", "pr-evidence", "--world-size", "2"]
    )
    assert run_request.preset_values(given)["world_size"] == 2
    monkeypatch.setattr(run_request, "_local_gpu_count", lambda: 0)
    bare = cli.build_parser().parse_args(["run", "--out", "x", "--preset", "pr-evidence"])
    assert run_request.preset_values(bare)["world_size"] == 2


@NEEDS_TRANSFORMERS
def test_on_cpu_the_pr_evidence_preset_shape_checks_on_a_scaled_down_qwen3(tmp_path):
    """The preset on qwen3-tiny with qwz's engine: the preflight accepts it, and one training
    step of the candidate with G 8192 and SDPA attention runs on the CPU."""
    import torch

    import qwz

    argv = ["run", "--out", str(tmp_path / "out"), "--preset", "pr-evidence"]
    args = cli.build_parser().parse_args([*argv, "--workload", "qwen3-tiny", "--subject", "qwz"])
    assert problems_of(args) == []
    planned = plan_of(args)
    assert planned.workload.params["attention"] == "sdpa"
    candidate = next(arm for arm in planned.arms if arm.group_size == 8192)
    assert candidate.allgather_bucket_size is None  # the user's bucket, not the chunked arm's
    model = planned.workload.build_model(planned.seed, dtype=torch.bfloat16)
    assert model.config._attn_implementation == "sdpa"
    engine = qwz.initialize(
        model, config=planned.arm_config(candidate), shard_alignment=planned.shard_alignment
    )
    loss = planned.workload.loss(engine.module, planned.workload.batch(seed=0, step=1, rank=0))
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss) and torch.isfinite(torch.as_tensor(engine.global_grad_norm))
