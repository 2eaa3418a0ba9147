"""The ``long`` preset end to end, shortened (``--steps 60``): the preset's workload, the
held-out loss of every batch, and the non-inferiority rule deciding ``learning``
([Note: non-inferiority over the horizon], qwz/qualify/evidence/rules/horizon.py).

The full preset (2,000 steps) is what ``benchmarks/power.py`` measures; here the horizon
is cut to 60 steps, evaluated every 10, so the window (steps 40-60) has 3 evaluations.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.evidence import record as records
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload
from tests import warm_python

pytestmark = pytest.mark.multigpu

CANDIDATE = "candidate-g64"
SHORT = ["--steps", "60", "--eval-every", "10", "--world-size", "2"]


def test_the_shortened_long_preset_passes_the_correct_candidate(tmp_path):
    command = ["-m", "qwz.qualify", "run", "--preset", "long"]
    done = warm_python.run(
        [*command, "--out", str(tmp_path), *SHORT],
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = records.load(tmp_path / "record.json")
    assert record.plan.preset == "long" and record.workload.name == "mlp-small"
    assert record.learning.rule == "non-inferiority" and record.workload.steps == 60
    assert record.performance == []  # no speed blocks
    for trajectory in record.trajectories:
        assert [h.step for h in trajectory.held_out] == [0, 10, 20, 30, 40, 50, 60]
        assert all(len(h.batch_losses) == 2 * 8 for h in trajectory.held_out)
    check = {c.name: c for c in record.checks}[f"learning[{CANDIDATE}]"]
    assert check.status == "pass" and check.numbers["window"] == [40, 60]
    assert check.numbers["batches"] == 16 and "upper bound" in check.detail
    assert "non-inferiority" in (tmp_path / "report.md").read_text()


PLAN = RunPlan(
    workload=get_workload("mlp-small"),
    steps=60,
    eval_every=10,
    held_out_batches=8,
    blocks=0,
    preset="long",
    learning_rule="non-inferiority",
    arm_hook="benchmarks.injectors:by_arm",
)


def test_moments_lost_half_way_fail_the_long_rule_alone(worlds):
    """Adam's moments zeroed after step 30 (the step count kept): every exactness check
    takes the state it is handed as given and passes; the held-out loss over the window
    is worse than the calibrated margin allows."""
    plan = dataclasses.replace(PLAN, extra={"injector": "moments-lost"})
    built = evidence.build_record(plan, worlds.get(2).run(qualify_rank, plan)[0])
    failing = {c.name: c.detail for c in built.checks if c.status == "fail"}
    assert built.verdict.status == "FAIL"
    assert list(failing) == [f"learning[{CANDIDATE}]"], failing
    assert "> margin" in failing[f"learning[{CANDIDATE}]"]
