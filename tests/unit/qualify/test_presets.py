"""``qwz-qualify run --preset``: qualify/presets.py through the parser and the plan."""

from __future__ import annotations

import pytest

from qwz.qualify import cli, preflight, presets, requirements
from qwz.qualify.plan import RunPlan
from qwz.qualify.run.workloads import get_workload


def plan(*argv: str) -> RunPlan:
    return preflight.plan_of(cli.build_parser().parse_args(["run", "--out", "x", *argv]))


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
    monkeypatch.setattr(presets, "_has_gpu_per_rank", lambda world_size, torchrun: False)
    planned = plan("--preset", "long")
    assert planned.workload == get_workload("mlp-small") and planned.steps >= 2000
    assert (planned.eval_every, planned.blocks, planned.held_out_batches) == (20, 0, 8)
    assert (planned.preset, planned.learning_rule) == ("long", "non-inferiority")
    # A flag given wins: a shortened long run is still judged by the long rule.
    short = plan("--preset", "long", "--steps", "60", "--eval-every", "10", "--workload", "mlp")
    assert (short.steps, short.eval_every, short.workload.name) == (60, 10, "mlp")
    assert short.learning_rule == "non-inferiority"


def test_the_long_preset_trains_qwen3_0_6b_where_every_rank_has_a_gpu(monkeypatch):
    monkeypatch.setattr(presets, "_has_gpu_per_rank", lambda world_size, torchrun: True)
    assert plan("--preset", "long").workload.name == "qwen3-0.6b"
    assert plan("--preset", "long", "--workload", "mlp-small").workload.name == "mlp-small"
    assert plan().workload.name == "qwen3-tiny"  # the default preset has no GPU choice


def test_an_unknown_preset_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["run", "--out", "x", "--preset", "longer"])
    assert exited.value.code == 2
    assert "invalid choice: 'longer' (choose from 'default', 'long')" in capsys.readouterr().err


def test_the_long_rule_needs_scipy_even_without_speed_blocks():
    wanted = requirements.needed(
        workload="mlp-small", subject="qwz", blocks=0, learning_rule="non-inferiority"
    )
    assert requirements.HORIZON_STATISTICS in wanted and requirements.TRANSFORMERS not in wanted
    assert requirements.HORIZON_STATISTICS not in requirements.needed(
        workload="mlp-small", subject="qwz", blocks=0
    )
