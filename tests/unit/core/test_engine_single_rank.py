"""The engine at world size 1 against plain torch.optim, its quantized step, and
NonFiniteError.

At world size 1 the master shard is the whole flat buffer and an optimizer step is the
same elementwise math as plain ``torch.optim`` on the separate parameters, so the engine
is compared with that reference by ``torch.equal``: any difference is a bug, not noise.
The one reduction, the global gradient norm, is compared within 1e-6 relative; see
[Clipping reference] for how the clipped step stays an exact comparison."""

from __future__ import annotations

import math
import types
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qwz

from .single_rank import ENGINE_EXAMPLES, floats

# --------------------------------------------------------------------------- #
# The engine against plain torch.optim on one process
# --------------------------------------------------------------------------- #

IN_FEATURES, HIDDEN, OUT_FEATURES = 5, 7, 3
MICRO_BATCH = 4
PRESERVE_NUMEL = 16
"""up.weight (35) and head.weight (21) are quantizable; up.bias (7), norm.weight and
norm.bias (7 each) and head.bias (3) travel exactly. 35 is not a multiple of 8, so groups
span two parameters."""


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.up(x))))


def build_model(seed: int) -> TinyNet:
    """Weights from a seeded generator (not the global RNG), so copies are identical."""
    model = TinyNet()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def make_batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [
        (
            torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator),
            torch.randn(MICRO_BATCH, OUT_FEATURES, generator=generator),
        )
        for _ in range(count)
    ]


def loss_of(model: qwz.Engine | TinyNet, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error in fp32 of the model's output on inputs cast to its dtype."""
    inputs, targets = batch
    module = model.module if isinstance(model, qwz.Engine) else model
    output = model(inputs.to(module.up.weight.dtype))
    return torch.nn.functional.mse_loss(output.float(), targets)


def ds_config(
    *,
    stage: int,
    optimizer: dict[str, Any],
    bucket: int,
    quantized: bool = False,
    group_size: int = 8,
    clipping: float = 0.0,
    accumulation: int = 1,
    dtype: str = "fp32",
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {
            "stage": stage,
            "zero_quantized_weights": quantized,
            "zero_quantized_weights_group_size": group_size,
            "zero_quantized_weights_preserve_numel": PRESERVE_NUMEL,
            "allgather_bucket_size": bucket,
            "reduce_bucket_size": 10,
        },
        "gradient_clipping": clipping,
        "gradient_accumulation_steps": accumulation,
        "optimizer": optimizer,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class Run(NamedTuple):
    """One training run: engine settings plus the matching torch optimizer."""

    stage: int
    seed: int
    steps: int
    bucket: int
    """allgather_bucket_size in elements: small values cut the gather into many chunks."""
    section: dict[str, Any]
    """The config's optimizer section."""
    torch_optimizer: type[torch.optim.Optimizer]
    torch_kwargs: dict[str, Any]


@st.composite
def adamw_runs(draw) -> Run:
    lr, eps = draw(floats(1e-4, 0.3)), draw(floats(1e-10, 1e-3))
    betas = (draw(floats(0.0, 0.99)), draw(floats(0.5, 0.9999)))
    weight_decay = draw(floats(0.0, 0.5))
    kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    section = {"type": "AdamW", "params": {**kwargs, "betas": list(betas)}}
    return Run(
        stage=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**31)),
        steps=draw(st.integers(1, 3)),
        bucket=draw(st.sampled_from([1, 8, 24, 5 * 10**8])),
        section=section,
        torch_optimizer=torch.optim.AdamW,
        torch_kwargs=kwargs,
    )


@st.composite
def sgd_runs(draw) -> Run:
    nesterov = draw(st.booleans())
    kwargs = {
        "lr": draw(floats(1e-4, 0.3)),
        "momentum": draw(floats(0.1, 0.99)),
        "dampening": 0.0 if nesterov else draw(floats(0.0, 0.5)),
        "weight_decay": draw(floats(0.0, 0.1)),
        "nesterov": nesterov,
    }
    base = draw(adamw_runs())
    return base._replace(
        section={"type": "SGD", "params": kwargs},
        torch_optimizer=torch.optim.SGD,
        torch_kwargs=kwargs,
    )


def assert_params_equal(engine: qwz.Engine, reference: torch.nn.Module, what: str) -> None:
    engine_params = dict(engine.module.named_parameters())
    reference_params = dict(reference.named_parameters())
    assert engine_params.keys() == reference_params.keys()
    for name, expected in reference_params.items():
        actual = engine_params[name].detach()
        difference = (actual.double() - expected.detach().double()).abs().max().item()
        assert torch.equal(actual, expected.detach()), f"{what}: {name} differs by {difference}"


def assert_close_norm(engine_norm: float | None, reference_norm: float, step: int) -> None:
    assert engine_norm is not None
    assert abs(engine_norm - reference_norm) <= 1e-6 * reference_norm, (
        f"step {step}: global_grad_norm {engine_norm} != reference {reference_norm}"
    )


def check_against_reference(run: Run, *, clipping: float = 0.0) -> None:
    """Train the engine and the plain reference side by side for `run.steps` steps."""
    reference = build_model(run.seed)
    engine = qwz.initialize(
        build_model(run.seed),
        config=ds_config(
            stage=run.stage, optimizer=run.section, bucket=run.bucket, clipping=clipping
        ),
    )
    reference_optimizer = run.torch_optimizer(reference.parameters(), **run.torch_kwargs)
    for step, batch in enumerate(make_batches(run.seed, run.steps), start=1):
        engine.backward(loss_of(engine, batch))
        assert engine.step()
        reference_optimizer.zero_grad()
        loss_of(reference, batch).backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()
        assert_close_norm(engine.global_grad_norm, reference_norm, step)
        if clipping:
            if step == 1:
                assert reference_norm > clipping, "clipping must be active to be tested"
            # [Clipping reference] torch's clip_grad_norm_ is get_total_norm followed by
            # clip_grads_with_norm_. The total norm is a reduction, and the engine sums its
            # squares in another order (flat regions, padding included) than torch (a norm of
            # per-parameter norms): the two fp32 norms may differ in the last bit, and so then
            # does the clip coefficient and every clipped gradient. So the reference clips
            # with torch's own clip_grads_with_norm_ at the engine's reported norm (compared
            # with torch's above), which keeps the comparison of the step exact.
            engine_norm = torch.tensor(engine.global_grad_norm, dtype=torch.float32)
            torch.nn.utils.clip_grads_with_norm_(reference.parameters(), clipping, engine_norm)
        reference_optimizer.step()
        assert_params_equal(engine, reference, f"step {step}")


@ENGINE_EXAMPLES
@given(run=adamw_runs())
def test_adamw_matches_torch_reference(run):
    check_against_reference(run)


@ENGINE_EXAMPLES
@given(run=adamw_runs(), clipping=floats(1e-3, 0.1))
def test_clipped_adamw_matches_torch_reference(run, clipping):
    check_against_reference(run, clipping=clipping)


@ENGINE_EXAMPLES
@given(run=sgd_runs())
def test_sgd_with_momentum_matches_torch_reference(run):
    check_against_reference(run)


@ENGINE_EXAMPLES
@given(run=adamw_runs())
def test_gradient_accumulation_matches_the_average_loss(run):
    """Two micro-batches per step: step() is a no-op on the first, steps on the second, and
    the result is the reference's step on the mean of the two losses."""
    reference = build_model(run.seed)
    engine = qwz.initialize(
        build_model(run.seed),
        config=ds_config(stage=run.stage, optimizer=run.section, bucket=run.bucket, accumulation=2),
    )
    reference_optimizer = run.torch_optimizer(reference.parameters(), **run.torch_kwargs)
    batches = make_batches(run.seed, 2 * run.steps)
    for step in range(1, run.steps + 1):
        first, second = batches[2 * step - 2], batches[2 * step - 1]
        engine.backward(loss_of(engine, first))
        assert engine.step() is False
        assert engine.global_steps == step - 1
        engine.backward(loss_of(engine, second))
        assert engine.step() is True
        assert engine.global_steps == step
        reference_optimizer.zero_grad()
        ((loss_of(reference, first) + loss_of(reference, second)) / 2).backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()
        reference_optimizer.step()
        assert_close_norm(engine.global_grad_norm, reference_norm, step)
        assert_params_equal(engine, reference, f"step {step}")


# --------------------------------------------------------------------------- #
# The quantized gather inside the engine at world size 1
# --------------------------------------------------------------------------- #


class QuantizedRun(NamedTuple):
    stage: int
    seed: int
    group_size: int
    bucket: int
    dtype: str


@st.composite
def quantized_runs(draw) -> QuantizedRun:
    return QuantizedRun(
        stage=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**31)),
        group_size=draw(st.sampled_from([8, 16, 32, 64])),
        bucket=draw(st.sampled_from([1, 16, 40, 5 * 10**8])),
        dtype=draw(st.sampled_from(["fp32", "bf16"])),
    )


ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}


def one_step(run: QuantizedRun, *, quantized: bool) -> types.SimpleNamespace:
    """One step of a ZeroOptimizer built directly: the engine gathers exactly on one rank
    ([Note: one rank gathers exactly], engine.py), so the quantized gather at world size 1
    is exercised one layer below it."""
    model = build_model(run.seed).to(torch.bfloat16 if run.dtype == "bf16" else torch.float32)
    optimizer = qwz.ZeroOptimizer(
        list(model.named_parameters()),
        stage=run.stage,
        optimizer=qwz.OptimizerSpec("adamw", ADAMW["params"]),
        gather=qwz.GatherPolicy(
            quantize=quantized,
            group_size=run.group_size,
            preserve_numel=PRESERVE_NUMEL,
            bucket_size=run.bucket,
        ),
        reduce=qwz.ReducePolicy(bucket_size=10),
    )
    loss_of(model, make_batches(run.seed, 1)[0]).backward()
    optimizer.accumulate_gradients()
    optimizer.step(1)
    return types.SimpleNamespace(module=model, optimizer=optimizer)


@ENGINE_EXAMPLES
@given(run=quantized_runs())
def test_quantized_step_decodes_each_parameter_from_its_master(run):
    """Parameters above preserve_numel hold dequantize(quantize(master)) of the groups of their
    region's flat buffer; the others hold their master exactly (cast to the working dtype)."""
    engine = one_step(run, quantized=True)
    optimizer = engine.optimizer
    assert optimizer.quantization_group_size == run.group_size
    params = dict(engine.module.named_parameters())
    dtype = params["up.weight"].dtype
    masters = optimizer.master_shards()
    seen = []
    for region in optimizer.regions:
        start, end = region.shard_range(0)
        assert (start, end) == (0, region.layout.padded_numel)  # one rank owns everything
        master = masters[region.name]
        assert master.dtype == torch.float32 and master.numel() == end
        if region.name == "quantized":
            working = qwz.dequantize(qwz.quantize(master, run.group_size), dtype)
        else:
            working = master.to(dtype)
        for slot in region.layout.slots:
            seen.append(slot.name)
            assert (slot.shape.numel() > PRESERVE_NUMEL) == (region.name == "quantized")
            expected = working[slot.offset : slot.end].view(slot.shape)
            assert torch.equal(params[slot.name].detach(), expected), slot.name
    assert sorted(seen) == sorted(params)
    if run.dtype == "fp32":  # otherwise the check above could not tell the gather quantized
        quantized = {region.name: region for region in optimizer.regions}["quantized"]
        assert not torch.equal(quantized.working.float(), masters["quantized"])


@ENGINE_EXAMPLES
@given(run=quantized_runs())
def test_quantized_master_equals_unquantized_master_after_one_step(run):
    """Identical start, identical gradients: quantizing the gather never touches the master."""
    quantized = one_step(run, quantized=True).optimizer.master_shards()
    reference = one_step(run, quantized=False).optimizer.master_shards()
    assert quantized.keys() == reference.keys()
    for name, master in reference.items():
        assert torch.equal(quantized[name], master), name


# --------------------------------------------------------------------------- #
# NonFiniteError
# --------------------------------------------------------------------------- #


def adamw_engine(seed: int, stage: int) -> qwz.Engine:
    return qwz.initialize(
        build_model(seed), config=ds_config(stage=stage, optimizer=ADAMW, bucket=24)
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_inf_loss_raises_naming_the_step_and_parameters(stage):
    engine = adamw_engine(0, stage)
    before = qwz.param_hash(engine.module)
    masters_before = {k: v.clone() for k, v in engine.optimizer.master_shards().items()}
    engine.backward(loss_of(engine, make_batches(0, 1)[0]) * math.inf)
    with pytest.raises(qwz.NonFiniteError) as raised:
        engine.step()
    message = str(raised.value)
    assert "step 1" in message
    for name, _ in engine.module.named_parameters():
        assert name in message, f"{name} missing from: {message}"
    assert qwz.param_hash(engine.module) == before
    for name, master in engine.optimizer.master_shards().items():
        assert torch.equal(master, masters_before[name]), name
    assert engine.global_steps == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_clean_step_after_non_finite_error_matches_a_fresh_engine(stage):
    """The failed step's gradients must not leak into the next step."""
    clean_batch, bad_batch = make_batches(0, 2)
    recovered = adamw_engine(0, stage)
    recovered.backward(loss_of(recovered, bad_batch) * math.inf)
    with pytest.raises(qwz.NonFiniteError):
        recovered.step()
    recovered.backward(loss_of(recovered, clean_batch))
    assert recovered.step()
    fresh = adamw_engine(0, stage)
    fresh.backward(loss_of(fresh, clean_batch))
    assert fresh.step()
    assert recovered.global_grad_norm == fresh.global_grad_norm
    assert qwz.param_hash(recovered.module) == qwz.param_hash(fresh.module)
