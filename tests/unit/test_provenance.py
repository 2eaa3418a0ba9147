"""The environment a record names: what the hash ledger keys reproducibility on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwz.qualify import provenance


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
    code = "from qwz.qualify import provenance; print(provenance.device_name())"

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
