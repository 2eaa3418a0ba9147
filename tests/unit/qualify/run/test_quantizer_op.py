"""The harness's CPU implementation of DeepSpeed's quantizer op ([Note: a CUDA-only subject on a
CPU runner], qwz/qualify/run/quantizer_op.py): it writes what the judge's own statement of the
scheme writes (qwz/qualify/evidence/zeropp.py; two independent writings of one arithmetic), on
the cases ``ci/gpu-check.sh`` compares with the CUDA kernel; and where DeepSpeed looks the op
up, it is found, or refused naming what the runner lacks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qwz.qualify.evidence import zeropp
from qwz.qualify.run import quantizer_op
from qwz.qualify.run.quantizer_op import CPU_OP, RunnerLacksCapability

SYMMETRIC = CPU_OP.Symmetric


def edge_cases(group_size: int) -> torch.Tensor:
    """Groups of `group_size` (fp32): random, an all-zero group, exact ties of the codes, a
    positive and a negative absmax, fp16 subnormals and values below them."""
    generator = torch.Generator().manual_seed(group_size)
    rows = [torch.randn(group_size, generator=generator) * 0.02, torch.zeros(group_size)]
    ties = (torch.arange(group_size) % 250 - 125 + 0.5) / 128
    ties[0] = 1.0  # absmax 1: q = 128, every other element an exact tie of the codes
    rows += [ties, -ties]  # a positive and a negative absmax
    tiny = torch.randn(group_size, generator=generator) * 2.0**-20  # fp16 subnormals
    tiny[1] = 2.0**-26  # flushed to zero by the staging
    rows.append(tiny)
    return torch.cat(rows)


def reference(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The judge's decode through fp16 from `values` staged as given (no exact elements)."""
    exact = torch.zeros(values.numel(), dtype=torch.bool)
    first = next(zeropp.decodes(values.float(), exact, group_size, torch.float16))
    return first.values[0]


@pytest.mark.parametrize("group_size", [8, 64, 8192])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_cpu_op_writes_the_judges_reference_decode_bit_for_bit(group_size, dtype):
    values = edge_cases(group_size).to(dtype)
    halves = values.half()  # what CUDAQuantizer hands the op
    codes, params = CPU_OP.quantize(halves, values.numel() // group_size, 8, SYMMETRIC)
    assert codes.dtype == torch.int8 and params.shape == (values.numel() // group_size, 1)
    decoded = CPU_OP.dequantize(codes, params, params.numel(), 8, SYMMETRIC)
    assert decoded.dtype == torch.float16
    expected = reference(values.float(), group_size)
    assert torch.equal(decoded.float(), expected)
    assert int(codes.min()) == -128 and int(codes.max()) == 127  # the clamp, both signs


def test_the_cpu_op_clamps_the_positive_absmax_and_keeps_the_negative():
    values = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0, 0.5, 0.25, 0.0], dtype=torch.float16)
    codes, params = CPU_OP.quantize(values, 2, 8, SYMMETRIC)
    assert codes.tolist() == [127, -64, 32, 0, -128, 64, 32, 0]
    assert params.reshape(-1).tolist() == [1 / 128, 1 / 128]


def test_an_infinite_input_decodes_its_group_to_nan():
    values = torch.tensor([1.0, float("inf"), 0.5, 0.0], dtype=torch.float16)
    codes, params = CPU_OP.quantize(values, 1, 8, SYMMETRIC)
    assert bool(torch.isnan(CPU_OP.dequantize(codes, params, 1, 8, SYMMETRIC)).all())


def test_what_the_cpu_op_does_not_implement_is_what_the_runner_lacks():
    values = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(RunnerLacksCapability, match="cannot run on this runner"):
        CPU_OP.quantize(values, 1, 4, SYMMETRIC)
    with pytest.raises(RunnerLacksCapability, match="Asymmetric"):
        CPU_OP.quantize(values, 1, 8, CPU_OP.Asymmetric)
    with pytest.raises(RunnerLacksCapability, match="swizzle_quant"):
        CPU_OP.swizzle_quant  # noqa: B018
    with pytest.raises(ValueError, match="equal groups"):
        CPU_OP.quantize(torch.zeros(10, dtype=torch.float16), 3, 8, SYMMETRIC)


def test_a_refusal_the_subject_wrapped_is_still_what_the_runner_lacks():
    quantizer_op.USAGE.refused, refused = 0, quantizer_op.USAGE.refused
    try:
        wrapped = RuntimeError("the optimizer could not build its quantizer")
        assert quantizer_op.explained(wrapped) is wrapped  # nothing refused: the subject's
        try:
            try:
                raise RunnerLacksCapability("cannot run on this runner: x")
            except RunnerLacksCapability as inner:
                raise RuntimeError("wrapped") from inner
        except RuntimeError as outer:
            assert isinstance(quantizer_op.explained(outer), RunnerLacksCapability)
        quantizer_op.USAGE.refused = 1
        lacking = quantizer_op.explained(wrapped)
        assert isinstance(lacking, RunnerLacksCapability) and lacking.__cause__ is wrapped
    finally:
        quantizer_op.USAGE.refused = refused


INSTALLED = textwrap.dedent(
    """
    import os, sys, torch
    os.environ["DS_ACCELERATOR"] = "cpu"
    from qwz.qualify.run import quantizer_op
    enabled = sys.argv[1] == "on"
    assert quantizer_op.install(enabled)
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
    try:
        quantizer = CUDAQuantizer()
    except quantizer_op.RunnerLacksCapability as error:
        print("REFUSED", error)
        raise SystemExit(0)
    x = torch.randn(256, dtype=torch.bfloat16)
    codes, scales = quantizer.quantize(x, groups=4)
    out = quantizer.dequantize(codes, scales, dtype=torch.bfloat16)
    report, substituted = quantizer_op.report(), quantizer_op.substituted()
    print("LOADED", out.dtype, tuple(scales.shape), report, substituted)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("enabled", ["on", "off"])
def test_deepspeeds_cuda_quantizer_finds_the_stand_in_or_its_refusal(enabled):
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install .[deepspeed])")
    if torch.cuda.is_available():
        pytest.skip("a CUDA runner loads DeepSpeed's own kernel; the stand-in is not installed")
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED, enabled], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if enabled == "on":
        assert "LOADED torch.bfloat16 (4, 1)" in done.stdout, done.stdout
        assert "'loaded': 1" in done.stdout and quantizer_op.WHAT_RAN in done.stdout
    else:
        assert "REFUSED cannot run on this runner: its quantizer needs CUDA" in done.stdout
        assert "--no-cpu-quantizer" in done.stdout


def test_a_conformance_row_the_runner_cannot_build_is_the_tables_error_not_a_refusal(
    monkeypatch, capsys
):
    """[Note: a CUDA-only subject on a CPU runner]: with the CPU implementation off, an engine
    whose quantizer op cannot load ends the table as the harness's error (inconclusive), never
    as the subject's refusal of that row; a refusal of the subject's own stays one."""
    import json

    from qwz.qualify.run import conformance_run

    def refused_load(config, qwz_gather):
        quantizer_op.USAGE.count("refused")
        raise RuntimeError("the optimizer could not build its weight quantizer")

    def own_refusal(config, qwz_gather):
        raise ValueError("zero_quantized_weights_group_size must be a multiple of 8")

    refused = quantizer_op.USAGE.refused
    try:
        monkeypatch.setitem(conformance_run._PARSE, "qwz", own_refusal)
        row = conformance_run.observe("qwz", "r", {"zero_optimization": {"stage": 2}}, True)
        assert row["observed"] == "refused" and "multiple of 8" in row["message"]
        monkeypatch.setitem(conformance_run._PARSE, "qwz", refused_load)
        with pytest.raises(conformance_run.RunnerCannot, match="cannot be built on this runner"):
            conformance_run.observe("qwz", "r", {"zero_optimization": {"stage": 2}}, True)
        monkeypatch.setattr(conformance_run, "_one_rank_world", lambda directory: None)
        conformance_run.serve({"subject": "qwz", "rows": [{"row": "r", "config": {}}],
                           "qwz_gather": True})  # fmt: skip
        said = json.loads(capsys.readouterr().out.split(conformance_run.MARKER, 1)[1])
        assert said["rows"] == [] and "cannot be built on this runner" in said["error"]
    finally:
        quantizer_op.USAGE.refused = refused
