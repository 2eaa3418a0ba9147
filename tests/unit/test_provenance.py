"""The environment a record names: what the hash ledger keys reproducibility on."""

from __future__ import annotations

import pytest
import torch

from qwz.qualify import provenance


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


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
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "oneDNN max AVX2" in provenance.device_name()
    assert _fingerprint() != native
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert _fingerprint() == native  # the same machine state: the same environment


@pytest.mark.usefixtures("on_cpu")
def test_the_cpu_name_says_the_architecture_and_vector_capability():
    name = provenance.device_name()
    assert name.startswith("cpu (")
    assert torch.backends.cpu.get_cpu_capability() in name
