"""ci/gpu-check.sh on a machine without a GPU, and the logic of its Python checks
(ci/gpu_checks.py) on the CPU, where they run synchronously."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "gpu-check.sh"
NO_GPU_EXIT = 3


def _load_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", REPO / "ci" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_checks = _load_checks()


def _run_script(tmp_path: pathlib.Path, nvidia_smi: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(nvidia_smi)
        fake.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "QWZ_VENV": str(tmp_path / "venv"),
        "QWZ_GPU_CHECK_OUT": str(tmp_path / "out"),
    }
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "nvidia_smi",
    [
        None,  # no NVIDIA tools at all
        "#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n",  # tools, no driver
        "#!/bin/sh\nexit 0\n",  # a driver that lists nothing
    ],
)
def test_without_a_gpu_it_says_no_gpu_installs_nothing_and_exits_3(tmp_path, nvidia_smi):
    done = _run_script(tmp_path, nvidia_smi)
    assert done.returncode == NO_GPU_EXIT, done.stderr
    assert "no GPU" in done.stderr and "exit 3 (skipped)" in done.stderr
    assert "no GPU" in (tmp_path / "out" / "summary.md").read_text()
    assert not (tmp_path / "venv").exists()  # nothing installed


def test_the_script_is_strict_bash():
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text.splitlines()[:30]
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_pipeline_check_passes_on_the_cpu(capsys):
    assert gpu_checks.main(["pipeline", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("PASS pipeline")


def test_the_pipeline_check_catches_a_gather_that_delivers_wrong_bytes(monkeypatch, capsys):
    """Broken on purpose: the delayed run's rank-1 row is left as a race would leave it."""
    monkeypatch.setattr(gpu_checks, "_gather_once", _half_broken(gpu_checks._gather_once))
    assert gpu_checks.main(["pipeline", "--device", "cpu"]) == 1
    assert "differ from the synchronous gather" in capsys.readouterr().out


def _half_broken(gather_once):
    """The delayed run gets a zeroed row 1, as a pipeline race would leave it."""

    def run(device, delayed):
        dest = gather_once(device, delayed)
        if delayed:
            dest[1].zero_()
        return dest

    return run


def test_the_engine_step_is_repeatable_on_the_cpu(capsys):
    assert gpu_checks.main(["engine-repeat", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("PASS engine-repeat")


def test_a_missing_device_byte_probe_is_named(monkeypatch, capsys):
    monkeypatch.setattr(gpu_checks, "KERNEL_CHECK", "qwz.quant:no_such_probe")
    assert gpu_checks.main(["kernel-bytes", "--device", "cpu"]) == 4
    assert "MISSING kernel-bytes: qwz.quant:no_such_probe is missing" in capsys.readouterr().out


def test_a_device_byte_probe_that_reports_a_difference_fails(monkeypatch, capsys):
    fake = types.ModuleType("fake_kernels")
    fake.check = lambda device, dtype: types.SimpleNamespace(
        ok=dtype != torch.float16, detail="3 rows differ"
    )
    monkeypatch.setitem(sys.modules, "fake_kernels", fake)
    monkeypatch.setattr(gpu_checks, "KERNEL_CHECK", "fake_kernels:check")
    assert gpu_checks.main(["kernel-bytes", "--device", "cpu"]) == 1
    assert capsys.readouterr().out.startswith("FAIL kernel-bytes")


def test_run_ci_does_not_call_the_gpu_check():
    assert "gpu-check" not in (REPO / ".ci" / "run").read_text()
    assert os.access(SCRIPT, os.X_OK)


def test_the_zeropp_op_check_holds_for_the_cpu_implementation(capsys):
    assert gpu_checks.main(["zeropp-op", "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("PASS zeropp-op: cpu: float16 G=8: codes 0/")
    assert "bfloat16 G=8192" in said and "judge: 0 outside the scheme" in said


def test_the_zeropp_op_check_fails_a_kernel_the_judge_does_not_accept(monkeypatch, capsys):
    """A kernel that drops the clamp (code 128 wraps to -128) is caught: the judge finds its
    decodes outside DeepSpeed's scheme and the comparison counts the differing codes."""
    from qwz.qualify.run import quantizer_op

    class Unclamped:
        Symmetric = quantizer_op.CPU_OP.Symmetric
        dequantize = staticmethod(quantizer_op.CPU_OP.dequantize)

        @staticmethod
        def quantize(values, groups, bits, kind):
            grouped = values.float().view(groups, -1)
            absmax = grouped.abs().amax(dim=1, keepdim=True)
            q = torch.where(absmax == 0, torch.ones_like(absmax), 128.0 / absmax)
            codes = torch.round(grouped * q).to(torch.int32).to(torch.int8)
            return codes.view(values.shape), torch.ones_like(q) / q

    monkeypatch.setattr(gpu_checks, "_deepspeed_quantizer_op", lambda device: Unclamped)
    assert gpu_checks.main(["zeropp-op", "--device", "cpu"]) == 1
    said = capsys.readouterr().out
    assert said.startswith("FAIL zeropp-op") and "outside the scheme" in said
    assert "judge: 0 outside" not in said.split("G=8:")[1].split(";")[0]


def test_an_op_that_cannot_be_built_is_named_not_passed(monkeypatch, capsys):
    def unbuildable(device):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(gpu_checks, "_deepspeed_quantizer_op", unbuildable)
    assert gpu_checks.main(["zeropp-op", "--device", "cpu"]) == 4
    assert "cannot be built here: RuntimeError: nvcc not found" in capsys.readouterr().out
