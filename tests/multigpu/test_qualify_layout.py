"""A correct candidate qualifies at world sizes 3, 4 and 8 with group sizes 64 and 8192 in one
run: every arm is laid out in shards of the group sizes' lcm ([Note: padding rule],
qwz/layout.py), so a gradient reduction of three or more terms runs in the same order in
every arm and the step-1 masters equal the reference's bit for bit.

Before that, each arm padded to its own group size, the elements' owners and reduction order
differed between arms, and ``step1-exact[candidate-g8192]`` failed at world size 4.
"""

from __future__ import annotations

import os

import pytest
import torch

from qwz.qualify.evidence import record
from tests import warm_python

pytestmark = pytest.mark.multigpu

TWO_GROUP_SIZES = [
    "--workload", "mlp", "--steps", "6", "--group-size", "64", "--group-size", "8192",
    "--blocks", "1", "--block-steps", "1", "--warmup-steps", "1", "--kernels", "eager",
]  # fmt: skip


EIGHT_RANKS_FIT = (os.cpu_count() or 1) >= 8 or torch.cuda.device_count() >= 8
"""Eight gloo ranks on fewer cores than that take minutes; on such a host W=8 is skipped."""


@pytest.mark.parametrize(
    "world_size",
    [
        3,
        4,
        pytest.param(
            8, marks=pytest.mark.skipif(not EIGHT_RANKS_FIT, reason="fewer than 8 cores or GPUs")
        ),
    ],
)
def test_correct_candidates_of_two_group_sizes_are_step1_exact(world_size, tmp_path):
    done = warm_python.run(
        ["-m", "qwz.qualify", "run", "--out", str(tmp_path),
         "--world-size", str(world_size), *TWO_GROUP_SIZES],
        timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    loaded = record.load(tmp_path / "record.json")
    checks = {check.name: check for check in loaded.checks}
    for size in (64, 8192):
        check = checks[f"step1-exact[candidate-g{size}]"]
        assert check.status == "pass", check.detail
        assert "bit for bit" in check.detail
    assert loaded.environment.world_size == world_size
    assert loaded.verdict.passed, loaded.verdict
    assert done.returncode == 0, done.stdout + done.stderr
