"""Kernel choice (qwz/kernels/): the ``torch.compile`` kernels write the eager kernels'
bytes, the divisions are exact however they are lowered ([Note: exact division]), and
compiled kernels never cross environments ([Note: compile cache per environment])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qwz
from qwz import kernels, optimizer, quant
from qwz.kernels import fused
from qwz.kernels.fused import FusedDecode
from qwz.kernels.self_tests import require_eager_bytes

aten = torch.ops.aten


# --------------------------------------------------------------------------- #
# torch.compile kernels, native kernels off: the eager kernels' bytes
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def torch_kernels():
    """Compiled kernels of their own (no native path) from a clean dynamo cache, with room
    for every row shape, so none falls back to eager (which would compare eager to eager)."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield fused.torch_kernels()
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, rows",
    [
        (torch.bfloat16, kernels.RAMP_ROWS + kernels.NATIVE_SELF_TEST_ROWS),
        (torch.float32, ()),
        (torch.float16, ()),
    ],
)
def test_fused_kernels_write_the_eager_bytes_on_rows_and_fp32_extremes(torch_kernels, dtype, rows):
    report = kernels.compare_with_eager("cpu", dtype, torch_kernels, rows=rows)
    assert torch_kernels.encode.fallback is None and torch_kernels.decode.fallback is None
    assert report.kernels == "fused" and report.rows_checked == len(rows) + 1
    assert report.ok, report.mismatches


def test_the_self_test_rows_hold_every_fp32_extreme():
    values = kernels.extreme_values()
    groups = values.view(-1, kernels.EXTREMES_GROUP_SIZE)
    tiny, largest = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    assert (groups == 0).all(dim=1).any()  # a zero group
    assert torch.signbit(values[values == 0]).any()  # -0
    subnormal = (values != 0) & (values.abs() < tiny)
    assert (
        subnormal.any() and (subnormal | (values == 0)).view_as(groups).all(dim=1).any()
    )  # the floor
    assert (values == largest).any() and (values == -largest).any()  # the overflow step
    assert ((groups > 0).any(dim=1) & (groups < 0).any(dim=1)).sum() >= 5  # mixed signs
    assert torch.isfinite(values).all()


def test_a_self_test_catches_kernels_that_write_other_bytes():
    """compare_with_eager is what decides: a kernel off by one code in one group is named."""

    def off_by_one(values, scales_out, codes_out):
        quant.encode_into(values, scales_out, codes_out)
        codes_out[0] = codes_out[0] ^ 1

    broken = kernels.QuantKernels("broken", off_by_one, quant.decode_into)
    report = kernels.compare_with_eager("cpu", torch.bfloat16, broken, rows=((8, 4, 5),))
    assert not report.ok and len(report.mismatches) == 2
    assert all(m.row_bytes_differ == 1 for m in report.mismatches)  # a zero group: decodes 0
    with pytest.raises(RuntimeError, match="broken kernels on cpu do not reproduce"):
        require_eager_bytes(report)


def test_compare_with_eager_refuses_an_unsupported_dtype():
    with pytest.raises(ValueError, match=r"dtype: torch\.float64 is invalid"):
        kernels.compare_with_eager("cpu", torch.float64)


def test_a_failing_self_test_on_a_device_means_eager_there(monkeypatch, caplog):
    """The process's fused kernels ask the self-test of the call's own device and dtype
    before compiling there: a failure (here: forced for fp16) runs that call eager, logged
    and recorded, and the bytes stay the eager ones."""
    asked = []

    def self_test_on(device, dtype):
        asked.append((device.type, dtype))
        return "forced failure" if dtype == torch.float16 else None

    decode = FusedDecode(None, self_test_on)
    scales, codes = torch.ones(2, 3), torch.ones(2, 24, dtype=torch.int8)
    out = torch.zeros(2, 24, dtype=torch.float16)
    with caplog.at_level("WARNING", logger="qwz"):
        decode(scales, codes, out)
    assert asked == [("cpu", torch.float16)]
    assert "torch.compile unusable (forced failure)" in decode.fallback
    expected = torch.zeros_like(out)
    quant.decode_into(scales, codes, expected)
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------- #
# [Note: exact division]: exact under approximate lowerings
# --------------------------------------------------------------------------- #


class ApproximateDivision(TorchDispatchMode):
    """Runs divisions the way CUDA may: a division by a scalar as a multiply by its
    reciprocal (eager CUDA with a CPU scalar; inductor's constant divisor on CUDA), and every
    other division and reciprocal `ulps` ulps high (Triton's approximate fp32 ``/``)."""

    def __init__(self, ulps: int = 2):
        super().__init__()
        self.ulps = ulps

    def _high(self, result: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ulps):
            result = torch.nextafter(result, torch.full_like(result, torch.inf))
        return result

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.div.Tensor, aten.div.Scalar) and not kwargs:
            numerator, divisor = args
            if not isinstance(divisor, torch.Tensor) or divisor.dim() == 0:
                reciprocal = 1.0 / float(divisor)  # rounded to the numerator's dtype below
                return numerator * torch.tensor(reciprocal, dtype=numerator.dtype)
            return self._high(func(*args))
        if func is aten.reciprocal.default:
            return self._high(func(*args))
        return func(*args, **kwargs)


def _random_fp32(count: int, seed: int) -> torch.Tensor:
    """Finite fp32 values from random bit patterns (every exponent), and the extremes."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**31 - 1, (count,), generator=generator, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    values = torch.where(torch.isfinite(values), values, torch.zeros_like(values))
    return torch.cat([values, kernels.extreme_values()])


def test_the_quantizer_writes_the_same_bytes_under_approximate_division():
    groups = _random_fp32(64 * 4096, seed=0)
    groups = groups[: groups.numel() // 64 * 64].view(-1, 64)
    # Groups of one element make the absmax every kind of fp32 value.
    singles = _random_fp32(1 << 16, seed=1)[:, None]
    for values in (groups, singles):
        codes, scales = quant.quantize_groups(values)
        with ApproximateDivision():
            approximate_codes, approximate_scales = quant.quantize_groups(values)
        assert torch.equal(scales.view(torch.int32), approximate_scales.view(torch.int32))
        assert torch.equal(codes, approximate_codes)


def test_approximate_division_changes_fp32_quotients():
    """The emulation is not a no-op: in fp32 it moves quotients and reciprocals, so a
    quantizer dividing in fp32 would write other bytes (the test above would fail)."""
    absmax = _random_fp32(1 << 16, seed=2).abs()
    with ApproximateDivision():
        scalar_quotient = absmax / 127
        reciprocal = 1.0 / absmax[absmax > 0]
    assert (scalar_quotient != absmax / 127).sum() > 100
    exact = 1.0 / absmax[absmax > 0]
    assert (reciprocal != exact)[torch.isfinite(exact)].all()


# --------------------------------------------------------------------------- #
# [Note: compile cache per environment]
# --------------------------------------------------------------------------- #

ENVIRONMENT_SCRIPT = """
import json, torch
from qwz import kernels, optimizer
values = torch.linspace(-3.0, 5.0, 100_003) * torch.linspace(0.5, 1.5, 100_003)
fused = optimizer._sum_of_squares(values, fused=True).item()
eager = sum(float(v) * float(v) for v in values.double().tolist())
report = kernels.compare_with_eager("cpu", torch.bfloat16, rows=())  # the extremes row: one shape
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "fused": fused, "eager": eager, "bytes_ok": report.ok,
    "mismatches": [m.against + str(m.group_size) for m in report.mismatches],
    "cache": kernels.compile_cache()._asdict(),
}))
"""
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _capped_environment() -> dict[str, str]:
    """A vector capability below this machine's: AVX2 under AVX-512, none under AVX2."""
    native = torch.backends.cpu.get_cpu_capability()
    if native.startswith("AVX512"):
        return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    if native == "AVX2":
        return {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    pytest.skip(f"ATen capability {native}: no lower vector capability to run under")


def _run(cache_root: Path, extra: dict[str, str]) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in CAPS}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(cache_root / "inductor"),
        QWZ_CACHE_DIR=str(cache_root / "qwz"),
        OMP_NUM_THREADS="1",
        **extra,
    )
    done = subprocess.run(
        [sys.executable, "-c", ENVIRONMENT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "capped_first",
    [
        pytest.param(False, id="native-then-capped"),
        # The same two environments and assertions in the other order: the nightly's.
        pytest.param(True, id="reverse", marks=pytest.mark.nightly),
    ],
)
def test_fused_kernels_are_right_in_both_environments_sharing_one_cache(tmp_path, capped_first):
    capped = _capped_environment()
    order = [capped, {}] if capped_first else [{}, capped]
    first, second = (_run(tmp_path, extra) for extra in order)
    assert first["capability"] != second["capability"]  # two environments, not one twice
    for result in (first, second):
        assert abs(result["fused"] - result["eager"]) <= 1e-9 * result["eager"], result
        assert result["bytes_ok"], result["mismatches"]
        cache = result["cache"]
        assert cache["directory"] == str(tmp_path / "inductor")
        assert cache["directory_source"] == "TORCHINDUCTOR_CACHE_DIR"
        assert f"qwz-env-{cache['fingerprint']}" in cache["cache_key_tag"]
    assert first["cache"]["fingerprint"] != second["cache"]["fingerprint"]


def test_the_fingerprint_names_the_isa_caps(monkeypatch):
    # A value no environment sets: the capped suite itself runs with some of these set.
    facts = kernels.environment_facts()
    for name in kernels.ISA_ENV_VARS:
        original = os.environ.get(name)
        monkeypatch.setenv(name, "qwz-test-isa")
        assert kernels.environment_fingerprint() != kernels.environment_fingerprint(facts), name
        if original is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, original)
    assert kernels.environment_fingerprint() == kernels.environment_fingerprint(facts)


def test_compile_cache_keeps_the_user_s_tag_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # torch's own patch(), not monkeypatch: a config module hides an entry deleted on undo.
    kernels.compile_cache.cache_clear()
    try:
        with torch.compiler.config.patch(cache_key_tag="mine"):
            cache = kernels.compile_cache()
            assert torch.compiler.config.cache_key_tag == f"mine+qwz-env-{cache.fingerprint}"
            assert cache.directory == str(tmp_path)
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
            assert cache.directory_source == "TORCHINDUCTOR_CACHE_DIR"
    finally:
        kernels.compile_cache.cache_clear()
    assert torch.compiler.config.cache_key_tag != "mine"


# --------------------------------------------------------------------------- #
# A failing self-test on the device: eager, recorded ([Note: fused kernels checked
# before a run], qualify/request/kernel_check.py)
# --------------------------------------------------------------------------- #

FORCED_FAILURE = "torch.compile on cuda:0: forced failure"


def test_a_failing_self_test_means_eager_kernels_and_the_reason_not_an_error(monkeypatch):
    """Fused kernels by default (None) fall back where their self-test fails -- on a GPU, a
    failed compile or other bytes (forced here on the CPU) -- and the engine keeps the
    reason; only an explicit ``fused_kernels=True`` makes the failure an error."""
    from qwz.kernels import choice

    monkeypatch.setattr(choice, "self_test", lambda device=None, dtype=None: FORCED_FAILURE)
    engine = _norm_engine()
    assert engine.optimizer.kernels.name == "eager"
    assert engine.optimizer.kernel_fallback == FORCED_FAILURE
    assert qwz.param_hash(engine.module) == qwz.param_hash(_norm_engine(fused_kernels=False).module)
    with pytest.raises(RuntimeError, match="fused_kernels=True but the fused kernels fail here"):
        _norm_engine(fused_kernels=True)


# --------------------------------------------------------------------------- #
# [Note: the norm's kernel] (optimizer.py)
# --------------------------------------------------------------------------- #


def _norm_engine(**keywords):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.05,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    engine = qwz.initialize(model, config=config, **keywords)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 16, generator=generator).bfloat16()
    loss = engine(inputs).float().square().mean()
    engine.backward(loss)
    engine.step()
    return engine


@pytest.mark.parametrize("fused_kernels", [None, True, False], ids=["default", "fused", "eager"])
def test_the_norm_is_eager_whatever_the_gather_kernels(monkeypatch, fused_kernels):
    asked, original = [], optimizer._sum_of_squares

    def recording(values, fused):
        asked.append(fused)
        return original(values, fused)

    monkeypatch.setattr(optimizer, "_sum_of_squares", recording)
    engine = _norm_engine(fused_kernels=fused_kernels)
    assert engine.optimizer.fused_norm is False and asked and not any(asked)
    assert engine.optimizer.kernels.name == ("eager" if fused_kernels is False else "fused")


def test_a_fused_norm_asked_for_serves_and_gives_the_eager_norm():
    eager, fused_norm = _norm_engine(), _norm_engine(fused_norm=True)
    assert fused_norm.optimizer.fused_norm is True
    assert fused_norm.global_grad_norm == eager.global_grad_norm
    assert qwz.param_hash(fused_norm.module) == qwz.param_hash(eager.module)


def test_a_fused_norm_that_fails_its_self_test_is_refused(monkeypatch):
    def wrong_sum_of_squares():
        return lambda values: optimizer._squares_float64(values) * 1.01

    monkeypatch.setattr(optimizer, "_fused_sum_of_squares", wrong_sum_of_squares)
    optimizer._fused_norm_self_test.cache_clear()
    try:
        assert optimizer.choose_norm(False, torch.device("cpu")) is False  # never asked
        with pytest.raises(RuntimeError, match=r"fused_norm=True but the fused norm fails"):
            optimizer.choose_norm(True, torch.device("cpu"))
    finally:
        optimizer._fused_norm_self_test.cache_clear()
