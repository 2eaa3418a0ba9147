"""``--dtype fp16`` before any rank starts: the DeepSpeed subjects are refused where
DeepSpeed's accelerator has no fp16 (exit 2, naming why), the qwz subject never asks.

A fake ``deepspeed`` checkout (``--deepspeed-src``) answers the preflight's question either
way, so both branches run on any machine; the last test asks the installed DeepSpeed.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from qwz.qualify import cli
from tests.extras import NEEDS_TRANSFORMERS
from tests.unit.qualify.request.test_run_preflight import parse, problems
from tests.unit.run_requests import plan_of

NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="needs DeepSpeed installed (the deepspeed extra: pip install 'qwz[deepspeed]'); "
    "the preflight refuses a DeepSpeed subject without it before asking about fp16",
)

FAKE_ACCELERATOR = """
import os


class _Accelerator:
    def device_name(self):
        return os.environ.get("DS_ACCELERATOR", "cuda")

    def is_fp16_supported(self):
        return {supported}


def get_accelerator():
    return _Accelerator()
"""


def fake_deepspeed(root: pathlib.Path, fp16_supported: bool) -> pathlib.Path:
    package = root / "deepspeed"
    (package / "accelerator").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.0.0+fake'\n")
    accelerator = FAKE_ACCELERATOR.format(supported=fp16_supported)
    (package / "accelerator" / "__init__.py").write_text(accelerator)
    return root


def fp16_problems(tmp_path, *argv: str) -> list[str]:
    # Not just "fp16" in the line: pytest's tmp_path names the test, so any line naming the
    # fake checkout (the seam preflight's, for one) contains "fp16".
    return [line for line in problems(tmp_path, *argv) if "refuses fp16" in line]


@NEEDS_DEEPSPEED
def test_deepspeed_without_fp16_is_refused_naming_why(tmp_path):
    source = fake_deepspeed(tmp_path / "ds", fp16_supported=False)
    found = fp16_problems(
        tmp_path, "--subject", "deepspeed", "--dtype", "fp16", "--deepspeed-src", str(source)
    )
    assert len(found) == 1
    # Two local CPU ranks run gloo: the preflight asked DeepSpeed's CPU accelerator.
    assert "DeepSpeed refuses fp16 on this machine: its cpu accelerator" in found[0]
    assert "AVX512-FP16" in found[0] and "--subject qwz qualifies fp16 here" in found[0]


@NEEDS_DEEPSPEED
def test_deepspeed_with_fp16_is_not_refused(tmp_path):
    source = fake_deepspeed(tmp_path / "ds", fp16_supported=True)
    argv = ("--subject", "deepspeed", "--dtype", "fp16", "--deepspeed-src", str(source))
    assert fp16_problems(tmp_path, *argv) == []


@NEEDS_DEEPSPEED
def test_bf16_never_asks(tmp_path):
    source = fake_deepspeed(tmp_path / "ds", fp16_supported=False)
    argv = ("--subject", "deepspeed", "--dtype", "bf16", "--deepspeed-src", str(source))
    assert fp16_problems(tmp_path, *argv) == []


@NEEDS_TRANSFORMERS
def test_the_qwz_subject_runs_fp16(tmp_path):
    assert problems(tmp_path, "--dtype", "fp16") == []
    assert plan_of(parse("--out", "x", "--dtype", "fp16")).fp16_initial_scale_power == 20


def _cpu_has_fp16() -> bool:
    """DeepSpeed's CPU accelerator's own question (oneDNN fp16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


@pytest.mark.parametrize("subject", ["deepspeed", "deepspeed-native"])
def test_the_installed_deepspeed_on_this_cpu(tmp_path, capsys, subject):
    """Exit 2 before any rank starts exactly where this CPU has no oneDNN fp16."""
    pytest.importorskip("deepspeed", reason="the DeepSpeed subjects need DeepSpeed installed")
    argv = ["run", "--workload", "mlp", "--subject", subject, "--dtype", "fp16"]
    argv += ["--steps", "1", "--blocks", "1", "--out", str(tmp_path / "out")]
    if _cpu_has_fp16():
        assert not fp16_problems(tmp_path, *argv[1:])
        return
    assert cli.main(argv) == 2
    assert "DeepSpeed refuses fp16 on this machine" in capsys.readouterr().err
    assert not (tmp_path / "out" / "record.json").exists()
