"""End to end: ``qwz-qualify run --ds-config FILE`` ([Note: the user's DeepSpeed config],
qwz/qualify/request/ds_config.py) on 2 spawned ranks, the tiny ``mlp`` workload, 4 steps, no speed
blocks: each arm's recorded config carries exactly the file's optimizer, buckets and
clipping, the update check re-derives the Adam the file asks for (DeepSpeed's FusedAdam
included: [Note: float32 hyperparameters]) and the run PASSes; an optimizer the check does
not re-derive is n/a, never a FAIL.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import pytest

from qwz.qualify.evidence import record
from tests import warm_python

pytestmark = pytest.mark.multigpu

RUN = [
    "--workload", "mlp", "--steps", "4", "--blocks", "0", "--world-size", "2",
    "--kernels", "eager",
]  # fmt: skip


def run(tmp_path: pathlib.Path, content: dict, *argv: str) -> tuple[record.Record, pathlib.Path]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    command = ["-m", "qwz.qualify", "run", "--out", str(tmp_path / "out")]
    done = warm_python.run(
        [*command, "--ds-config", str(path), *RUN, *argv],
        timeout=1200,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return record.load(tmp_path / "out" / "record.json"), path


def assert_arms_carry(loaded: record.Record, content: dict) -> None:
    for arm in loaded.arms:
        config = arm.config
        assert config["optimizer"] == content["optimizer"], arm.name
        assert config["gradient_clipping"] == content["gradient_clipping"], arm.name
        zero = config["zero_optimization"]
        assert zero["reduce_bucket_size"] == content["zero_optimization"]["reduce_bucket_size"]
        assert zero["zero_quantized_weights"] is arm.quantized


def deepspeed_adam(torch_adam: bool) -> dict:
    return {
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "torch_adam": torch_adam, "adam_w_mode": True},
        },
        "zero_optimization": {"reduce_bucket_size": 1e8},
        "gradient_clipping": 0,
    }


@pytest.mark.parametrize(
    ("torch_adam", "optimizer_class"),
    [
        (True, "torch.optim.adamw.AdamW"),
        # Nightly: DeepSpeed JIT-builds FusedAdam's CPU op for this test alone (one to two
        # minutes on 2 cores). In CI, tests/unit/qualify/run/observers/test_observers.py re-derives
        # a fused Adam with float32 hyperparameters and test_ds_config.py reads its config.
        pytest.param(False, "deepspeed.ops.adam.fused_adam.FusedAdam", marks=pytest.mark.nightly),
    ],
)
def test_deepspeed_s_adam_from_the_file_runs_in_every_arm_and_passes(
    tmp_path, torch_adam, optimizer_class
):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    content = deepspeed_adam(torch_adam)
    loaded, path = run(tmp_path, content, "--subject", "deepspeed")
    assert loaded.verdict.status == "PASS", loaded.verdict
    assert_arms_carry(loaded, content)
    ds_config = loaded.plan.ds_config
    assert ds_config.content == content
    assert ds_config.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    plan = loaded.plan.model_dump()
    assert (plan["gradient_clipping"], plan["reduce_bucket_size"]) == (0.0, 100_000_000)
    assert plan["torch_adam"] is torch_adam
    # Adam's weight decay: 0 for DeepSpeed's FusedAdam, torch's 0.01 for its AdamW.
    assert plan["weight_decay"] == (0.01 if torch_adam else 0.0)
    checks = {check.name: check for check in loaded.checks}
    for updates in loaded.updates:
        assert updates.optimizer == optimizer_class and updates.checked > 0
        assert checks[f"update[{updates.arm}]"].status == "pass"
    assert checks["step1-exact[candidate-g64]"].status == "pass"


def test_qwz_s_engine_takes_the_file_too(tmp_path):
    content = {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.05},
        },
        "zero_optimization": {"reduce_bucket_size": 1e8},
        "gradient_clipping": 0.5,
    }
    loaded, _ = run(tmp_path, content, "--subject", "qwz")
    assert loaded.verdict.status == "PASS", loaded.verdict
    assert_arms_carry(loaded, content)
    assert all(updates.optimizer == "torch.optim.adamw.AdamW" for updates in loaded.updates)
    plan = loaded.plan.model_dump()
    assert (plan["lr"], plan["weight_decay"], plan["gradient_clipping"]) == (2e-3, 0.05, 0.5)


def test_an_optimizer_the_update_check_does_not_re_derive_is_n_a_not_a_fail(tmp_path):
    content = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {"reduce_bucket_size": 1e8},
        "gradient_clipping": 0,
    }
    loaded, _ = run(tmp_path, content, "--subject", "qwz")
    assert loaded.verdict.status == "PASS", loaded.verdict
    for updates in loaded.updates:
        check = next(item for item in loaded.checks if item.name == f"update[{updates.arm}]")
        assert check.status == "n/a" and "the optimizer is 'SGD'" in check.detail
        assert updates.optimizer == "torch.optim.sgd.SGD" and updates.norm_checked == 4
    assert all(drift.bound == [] for drift in loaded.drift)  # Adam's bound: not for SGD
