"""The calibration arm's noise ([Note: calibration noise on the device],
qwz/qualify/run/calibration_noise.py): uniform in [-scale/2, scale/2] per group, the same
for the same (seed, step) whatever the chunking (so on every rank, on any device), another
for another step, drawn with no host read, and the generator's integers never overflow."""

from __future__ import annotations

import torch

from qwz.qualify.evidence import spec
from qwz.qualify.run import calibration_noise
from tests.unit.core.host_reads import HostReads

GROUP_SIZE = 64


def _module(seed: int = 0) -> torch.nn.Module:
    """A quantized weight of 3 * 70_000 elements (one partial last group) beside small
    parameters that travel exactly, in bf16."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(70_000, 3), torch.nn.LayerNorm(3))
    with torch.no_grad():
        module[0].weight.mul_(torch.linspace(0.1, 10.0, 210_000).view(3, -1))
    return module.to(torch.bfloat16)


def _noise(module: torch.nn.Module, seed: int, step: int) -> dict[str, torch.Tensor]:
    """What perturb adds to each parameter, in fp32."""
    before = {name: p.detach().float().clone() for name, p in module.named_parameters()}
    calibration_noise.perturb(module, GROUP_SIZE, seed, step)
    return {name: p.detach().float() - before[name] for name, p in module.named_parameters()}


def test_the_noise_is_uniform_within_half_a_scale_per_group():
    module = _module()
    weight = module[0].weight.detach().reshape(-1).clone()
    scales = spec.scales(weight, GROUP_SIZE)
    added = _noise(module, seed=3, step=1)
    # The exact noise, before its cast to bf16 and the bf16 addition: the draws themselves.
    keys = calibration_noise._keys(3, 1, "0.weight")
    draws = calibration_noise.uniform(keys, 0, scales.numel() * GROUP_SIZE, weight.device)
    relative = (draws - 0.5)[: weight.numel()]
    assert relative.min() >= -0.5 and relative.max() < 0.5
    assert abs(float(relative.mean())) < 0.003 and abs(float(relative.var()) - 1 / 12) < 0.002
    element_scales = scales.repeat_interleave(GROUP_SIZE)[: weight.numel()]
    expected = (relative * element_scales).to(torch.bfloat16)
    assert torch.equal(module[0].weight.detach().reshape(-1), weight + expected)
    assert (added["0.weight"].reshape(-1).abs() <= element_scales).all()
    for name in ("0.bias", "1.weight", "1.bias"):  # small parameters travel exactly
        assert not added[name].any(), name


def test_the_same_seed_and_step_draw_the_same_noise_whatever_the_chunking(monkeypatch):
    """Two ranks (two modules from one seed) draw the same bits; so does a rank that draws
    in chunks of another size (the element's draw depends on its index alone)."""
    whole = _noise(_module(), seed=5, step=2)
    assert torch.equal(_noise(_module(), seed=5, step=2)["0.weight"], whole["0.weight"])
    monkeypatch.setattr(calibration_noise, "NOISE_CHUNK_NUMEL", 3 * GROUP_SIZE)
    assert torch.equal(_noise(_module(), seed=5, step=2)["0.weight"], whole["0.weight"])
    for seed, step in ((5, 3), (6, 2)):  # seeded per step and per run
        assert not torch.equal(_noise(_module(), seed, step)["0.weight"], whole["0.weight"])


def test_the_generator_never_overflows():
    """The int64 tensor arithmetic equals the same arithmetic on Python's unbounded
    integers, at indices far beyond any parameter: no intermediate value wrapped."""
    keys = calibration_noise._keys(7, 11, "w")
    start = 3 * 2**40 + 12_345

    def reference(index: int) -> float:
        prime = calibration_noise.PRIME
        x = (index % prime + index // prime * calibration_noise.HIGH_MULTIPLIER + keys[-1]) % prime
        for multiplier, key in zip(calibration_noise.MULTIPLIERS, keys, strict=False):
            x = (x * multiplier + key) % prime
            x ^= x >> 16
        return (x >> 7) * 2.0**-24

    drawn = calibration_noise.uniform(keys, start, 8, torch.device("cpu"))
    assert drawn.tolist() == [reference(start + offset) for offset in range(8)]


def test_the_noise_is_drawn_without_a_host_read():
    module = _module()
    with HostReads() as counter:
        calibration_noise.perturb(module, GROUP_SIZE, 0, 1)
    assert [read for read in counter.reads if "calibration_noise" in read.where] == []
    assert [read for read in counter.reads if "spec.py" in read.where] == []
