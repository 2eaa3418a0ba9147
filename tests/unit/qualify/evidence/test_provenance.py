"""The environment a record names: what the hash ledger keys reproducibility on."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from qwz.qualify.evidence import provenance
from qwz.qualify.run import determinism


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for variable in provenance.ISA_CAPS:
        monkeypatch.delenv(variable, raising=False)


def _fingerprint() -> str:
    name = provenance.device_name()
    return provenance.environment([name, name]).fingerprint()


@pytest.mark.usefixtures("on_cpu")
def test_cpus_that_round_matmuls_differently_are_different_environments(monkeypatch):
    """A bf16-capable CPU and one that emulates bf16 (or is capped by ONEDNN_MAX_CPU_ISA)
    give different hashes for the same head; the ledger must not compare them."""
    monkeypatch.setattr(provenance, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    native = _fingerprint()
    assert "avx512_bf16" in provenance.device_name()
    monkeypatch.setattr(provenance, "_cpu_flags", lambda: {"avx2", "avx512f"})
    assert _fingerprint() != native
    monkeypatch.setattr(provenance, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in provenance.device_name()
    capped = _fingerprint()
    assert capped != native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2 ")  # oneDNN reads it case-insensitively
    assert _fingerprint() == capped
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert _fingerprint() == native  # the same machine state: the same environment


def test_aten_s_vector_capability_is_part_of_the_name():
    """ATEN_CPU_CAPABILITY is read once per process, hence the subprocesses."""
    code = "from qwz.qualify.evidence import provenance; print(provenance.device_name())"

    def name(capability: str) -> str:
        env = {"ATEN_CPU_CAPABILITY": capability, "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    assert name("default").startswith("cpu (") and "DEFAULT" in name("default")
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert name("default") != name(torch.backends.cpu.get_cpu_capability().lower())


X86 = "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"


@pytest.mark.parametrize(
    ("text", "flags"),
    [
        (X86, {"fpu", "avx2", "avx512_bf16"}),
        (ARM, {"fp", "asimd", "bf16", "sve"}),
        ("processor\t: 0\nmodel name\t: something\n", set()),
    ],
)
def test_cpu_flags_are_read_from_cpuinfo(tmp_path, text, flags):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert provenance._cpu_flags(cpuinfo) == flags


def test_no_cpuinfo_means_no_flags(tmp_path):
    assert provenance._cpu_flags(tmp_path / "missing") == set()


# --------------------------------------------------------------------------- GPU provenance


def _environment(**changes) -> provenance.Environment:
    base = provenance.environment(["NVIDIA H200"], ["sm_90"], determinism.current())
    return base.model_copy(update=changes)


def test_gpu_versions_and_compute_capability_are_in_the_fingerprint():
    """Hashes from two CUDA, cuDNN, NCCL, driver or Triton versions, or from two compute
    capabilities, are not comparable; the ledger must tell them apart."""
    base = _environment(cuda="12.8", cudnn="91002", nccl="2.27.3", driver="570.1", triton="3.4")
    for field, other in [
        ("cuda", "12.9"),
        ("cudnn", "91100"),
        ("nccl", "2.28.0"),
        ("driver", "575.2"),
        ("triton", "3.5"),
        ("compute_capabilities", ["sm_80"]),
    ]:
        assert base.model_copy(update={field: other}).fingerprint() != base.fingerprint(), field


def test_deterministic_settings_are_in_the_fingerprint():
    base = _environment()
    loose = base.determinism.model_copy(update={"cudnn_benchmark": True})
    assert base.model_copy(update={"determinism": loose}).fingerprint() != base.fingerprint()


def test_a_record_from_before_the_gpu_fields_keeps_its_fingerprint():
    """Fields a record written before them lacks are left out: an older ledger entry still
    matches the same environment."""
    fields = dict(
        python="3.11.9",
        torch="2.13.0",
        deepspeed="0.19.8",
        transformers=None,
        backend="gloo",
        device_names=["cpu (x86_64, AVX512)"] * 2,
        world_size=2,
        node_count=1,
        platform="Linux",
    )
    old_payload = {key: value for key, value in fields.items() if key != "platform"}
    old = hashlib.sha256(json.dumps(old_payload, sort_keys=True).encode()).hexdigest()[:16]
    assert provenance.Environment(**fields).fingerprint() == old


def test_compute_capability_of_a_gpu_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert provenance.compute_capability() == "sm_90"


@pytest.mark.usefixtures("on_cpu")
def test_a_cpu_rank_has_no_compute_capability():
    assert provenance.compute_capability() is None


def test_driver_version_from_the_kernel_module(tmp_path):
    version_file = tmp_path / "version"
    version_file.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0\n"
    )
    assert provenance.driver_version(version_file) == "550.54.15"
    assert provenance.driver_version(tmp_path / "absent") is None


def test_deterministic_settings_apply_inside_and_are_restored(monkeypatch):
    monkeypatch.delenv(determinism.CUBLAS_WORKSPACE_ENV, raising=False)
    before = determinism.current()
    with determinism.deterministic() as inside:
        assert torch.are_deterministic_algorithms_enabled()
        assert inside.deterministic_algorithms and inside.warn_only
        assert inside.cublas_workspace_config == determinism.CUBLAS_WORKSPACE_CONFIG
        assert inside.cudnn_deterministic and not inside.cudnn_benchmark
        assert not inside.fill_uninitialized_memory
        assert inside == determinism.current()
    assert determinism.current() == before
    assert determinism.CUBLAS_WORKSPACE_ENV not in os.environ


def test_a_cublas_workspace_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv(determinism.CUBLAS_WORKSPACE_ENV, ":16:8")
    with determinism.deterministic() as inside:
        assert inside.cublas_workspace_config == ":16:8"
    assert os.environ[determinism.CUBLAS_WORKSPACE_ENV] == ":16:8"
