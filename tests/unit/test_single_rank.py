"""Single-rank properties of the core: layout, chunk plans, the gather, the optimizer step,
hashing, the wire probe and the tolerance bound.

No process group is initialised here, so every function runs at world size 1 with the
collectives skipped -- the same code the multigpu suite runs with real ranks (STYLE.md,
"world_size == 1 is the same code"). These are the only tests of the core in the PR
workflow, on CPU.

At world size 1 the master shard is the whole flat buffer and an optimizer step is the
same elementwise math as plain ``torch.optim`` on the separate parameters, so the engine
is compared with that reference by ``torch.equal``: any difference is a bug, not noise.
The one reduction, the global gradient norm, is compared within 1e-6 relative; see
[Clipping reference] for how the clipped step stays an exact comparison.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import qwz
from qwz.collectives import Staging, gather
from qwz.layout import build_layout, plan_gather
from qwz.probe import WireProbe
from qwz.tolerance import adam_update_bound

from .strategies import tensors


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """pytest-xdist already runs one worker per core; torch's intra-op threads on top of
    that oversubscribe the cores (see test_quant.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_no_process_group():
    """Everything below relies on running without one (world size 1)."""
    assert not (dist.is_available() and dist.is_initialized())


def fewer_examples(divisor: int) -> settings:
    """The loaded profile's example count divided by `divisor` (at least 5), for properties
    whose examples cost milliseconds each (an engine run, a gather of thousands of
    elements), so the file stays within a few seconds in CI and nightly still runs more."""
    return settings(max_examples=max(5, settings().max_examples // divisor))


ENGINE_EXAMPLES = fewer_examples(4)


def alignments() -> st.SearchStrategy[int]:
    """1 (an exact buffer) or a quantization group size (a positive multiple of 8)."""
    return st.one_of(st.just(1), st.integers(1, 64).map(lambda k: 8 * k))


# --------------------------------------------------------------------------- #
# layout.build_layout / FlatLayout: [Note: padding rule]
# --------------------------------------------------------------------------- #


@st.composite
def named_shapes(draw, *, min_dim: int = 0, min_count: int = 0) -> list[tuple[str, torch.Size]]:
    """Up to 6 uniquely named shapes of 0 to 3 dimensions (a 0-dim shape has one element)."""
    count = draw(st.integers(min_count, 6))
    return [
        (f"p{index}", torch.Size(draw(st.lists(st.integers(min_dim, 12), max_size=3))))
        for index in range(count)
    ]


class LayoutCase(NamedTuple):
    named_shapes: list[tuple[str, torch.Size]]
    world_size: int
    alignment: int


@st.composite
def layout_cases(draw, *, min_dim: int = 0) -> LayoutCase:
    return LayoutCase(
        draw(named_shapes(min_dim=min_dim)), draw(st.integers(1, 8)), draw(alignments())
    )


@given(case=layout_cases())
def test_layout_pads_to_equal_aligned_shards(case):
    flat = build_layout(case.named_shapes, case.world_size, case.alignment)
    numel = sum(shape.numel() for _, shape in case.named_shapes)
    assert flat.numel == numel
    assert flat.padded_numel >= numel
    assert flat.padded_numel == case.world_size * flat.shard_numel
    assert flat.shard_numel % case.alignment == 0
    assert flat.padded_numel - numel < case.world_size * case.alignment
    # The ranks' shards tile [0, padded_numel) in rank order.
    ranges = [flat.shard_range(rank) for rank in range(case.world_size)]
    assert [start for start, _ in ranges] == [0] + [end for _, end in ranges[:-1]]
    assert ranges[-1][1] == flat.padded_numel


@given(case=layout_cases())
def test_layout_slots_are_back_to_back_in_order(case):
    flat = build_layout(case.named_shapes, case.world_size, case.alignment)
    assert [(slot.name, slot.shape) for slot in flat.slots] == case.named_shapes
    offset = 0
    for slot in flat.slots:
        assert slot.offset == offset
        assert slot.end == offset + slot.shape.numel()
        offset = slot.end
    assert flat.numel == offset


def brute_force_names_in_range(
    named_shapes: list[tuple[str, torch.Size]], start: int, end: int
) -> list[str]:
    """Label every element with its parameter's name and read the labels in [start, end)."""
    owners = [name for name, shape in named_shapes for _ in range(shape.numel())]
    seen = set(owners[max(start, 0) : max(end, 0)])
    return [name for name, _ in named_shapes if name in seen]


@st.composite
def ranges_in_layout(draw) -> tuple[LayoutCase, int, int]:
    """A layout of non-empty parameters and a non-empty [start, end) range, possibly reaching
    into the padding or past it (empty ranges: the test after the property)."""
    case = draw(layout_cases(min_dim=1))
    padded = build_layout(case.named_shapes, case.world_size, case.alignment).padded_numel
    start = draw(st.integers(0, padded + 2))
    return case, start, draw(st.integers(start + 1, padded + 3))


@given(case_range=ranges_in_layout())
def test_names_in_range_matches_brute_force(case_range):
    case, start, end = case_range
    flat = build_layout(case.named_shapes, case.world_size, case.alignment)
    assert flat.names_in_range(start, end) == brute_force_names_in_range(
        case.named_shapes, start, end
    )


@pytest.mark.parametrize("position", [0, 1, 2, 3, 5])
def test_names_in_range_of_an_empty_range_is_empty(position):
    """An empty range [i, i) holds no element, so it overlaps no parameter, even one that
    spans position i."""
    flat = build_layout([("a", torch.Size([3])), ("b", torch.Size([2]))], 1, 1)
    assert flat.names_in_range(position, position) == []


# --------------------------------------------------------------------------- #
# layout.plan_gather: [Note: staging bound], [Note: wire row]
# --------------------------------------------------------------------------- #


class GatherProblem(NamedTuple):
    world_size: int
    source_numel: int
    quantize: bool
    group_size: int
    unit_numel: int
    element_size: int
    budget_bytes: int
    exact_numel: int
    exact_runs: tuple[tuple[tuple[int, int], ...], ...] | None

    def plan(self):
        return plan_gather(**self._asdict())


@st.composite
def gather_problems(draw) -> GatherProblem:
    """A main stream (quantized or not, possibly not a whole number of groups), an exact
    stream of its own (quota) or inside the main stream (runs), and a budget below one
    minimal chunk, around the whole gather, or anywhere."""
    world_size = draw(st.integers(1, 6))
    group_size = 8 * draw(st.integers(1, 16))
    quantize = draw(st.booleans())
    unit_numel = group_size if quantize else draw(st.sampled_from([1, group_size]))
    element_size = draw(st.sampled_from([2, 4]))
    source_numel = draw(st.integers(0, 40)) * unit_numel - draw(st.integers(0, unit_numel - 1))
    source_numel = max(source_numel, 0)
    exact_numel, exact_runs = 0, None
    mode = draw(st.sampled_from(["none", "quota", "runs"]))
    if mode == "quota":
        exact_numel = draw(st.integers(1, 300))
    elif mode == "runs" and source_numel:
        owners = []
        for _ in range(world_size):
            cuts = sorted(set(draw(st.lists(st.integers(0, source_numel), max_size=8))))
            owners.append(tuple(zip(cuts[::2], cuts[1::2], strict=False)))
        exact_runs = tuple(owners)
    if source_numel == 0 and exact_numel == 0:
        exact_numel = 1
    whole = world_size * (source_numel * 2 + exact_numel * element_size + 64)
    budget_bytes = draw(
        st.one_of(st.integers(0, 200), st.integers(whole // 4, 2 * whole), st.integers(0, 2**40))
    )
    return GatherProblem(
        world_size,
        source_numel,
        quantize,
        group_size,
        unit_numel,
        element_size,
        budget_bytes,
        exact_numel,
        exact_runs,
    )


def _exact_elements(problem: GatherProblem) -> list[set[int]]:
    if problem.exact_runs is not None:
        return [{i for s, e in runs for i in range(s, e)} for runs in problem.exact_runs]
    return [set(range(problem.exact_numel)) for _ in range(problem.world_size)]


@given(problem=gather_problems())
def test_gather_plan_moves_every_element_once_in_rows_that_hold_it(problem):
    plan = problem.plan()
    position = 0
    for index, chunk in enumerate(plan.chunks):
        assert chunk.start == min(position, problem.source_numel)
        last = index == len(plan.chunks) - 1 or plan.chunks[index + 1].end == chunk.end
        if not last:  # whole units except at the end of the stream
            assert (chunk.end - chunk.start) % problem.unit_numel == 0
        position = chunk.end
        row = chunk.row
        if problem.quantize:
            assert row.num_groups * problem.group_size >= chunk.end - chunk.start
            if row.num_groups:  # rows that carry scales keep the next row's aligned
                assert row.row_bytes % 4 == 0 and row.row_bytes - row.payload_bytes < 4
        else:
            assert row.raw_numel == chunk.end - chunk.start and row.row_bytes == row.payload_bytes
        for owner in range(problem.world_size):
            own = [piece for piece in chunk.pieces if piece.owner == owner]
            offsets = [piece.row_offset for piece in own]
            assert offsets == sorted(offsets)
            assert sum(piece.numel for piece in own) <= row.exact_numel
            if problem.exact_runs is not None:  # travels with the chunk that covers it
                assert all(chunk.start <= p.source_offset < chunk.end for p in own)
    assert position == problem.source_numel
    seen: list[list[int]] = [[] for _ in range(problem.world_size)]
    for chunk in plan.chunks:
        for piece in chunk.pieces:
            assert piece.source_offset == piece.dest_offset
            seen[piece.owner] += range(piece.source_offset, piece.source_offset + piece.numel)
    expected = _exact_elements(problem)
    for owner in range(problem.world_size):
        assert sorted(seen[owner]) == sorted(expected[owner]), owner


@given(problem=gather_problems())
def test_staging_of_both_buffers_within_the_budget_or_one_minimal_chunk(problem):
    """[Note: staging bound] with two buffers: both together within the budget; when half
    of it cannot hold one minimal chunk, one buffer of exactly that chunk."""
    plan = problem.plan()
    world_size = problem.world_size
    assert plan.staging_bytes == plan.num_buffers * world_size * plan.row_bytes
    if plan.num_buffers == 2:
        assert plan.staging_bytes <= problem.budget_bytes
    elif plan.staging_bytes > problem.budget_bytes:
        # Over budget only with the smallest chunk: one unit per rank, plus one exact
        # element (quota) or the exact elements inside that unit (runs).
        unit_bytes = (
            problem.unit_numel + 4
            if problem.quantize
            else problem.unit_numel * problem.element_size
        )
        exact = problem.unit_numel if problem.exact_runs is not None else 1
        minimal = -(-(unit_bytes + exact * problem.element_size) // 4) * 4
        assert plan.row_bytes <= minimal
    assert plan.wire_bytes() == (
        0 if world_size == 1 else sum(chunk.row.row_bytes for chunk in plan.chunks)
    )


def test_staging_bound_is_caught_by_the_two_buffer_rule():
    """The budget that holds the whole gather once but not twice: two buffers of half."""
    problem = GatherProblem(2, 64 * 10, True, 64, 64, 2, 2 * 10 * 68, 0, None)
    plan = problem.plan()
    assert plan.num_buffers == 2 and plan.staging_bytes <= problem.budget_bytes
    assert len(plan.chunks) == 2


# --------------------------------------------------------------------------- #
# collectives.gather at world size 1
# --------------------------------------------------------------------------- #

WORKING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GatherCase(NamedTuple):
    local_shard: torch.Tensor
    """fp32 (shard_numel,), magnitudes within fp16's range."""
    dtype: torch.dtype
    group_size: int
    budgets: list[int]
    """Staging budgets in bytes: below one unit, one unit, random, unbounded."""


@st.composite
def gather_cases(draw) -> GatherCase:
    group_size = draw(st.one_of(st.sampled_from([8, 64]), st.integers(1, 32).map(lambda k: 8 * k)))
    num_groups = draw(st.integers(0, 24))
    local_shard = draw(tensors(num_groups * group_size, torch.float32, (-20, 15))).reshape(-1)
    largest = (num_groups + 1) * (group_size + 4) * 4
    budgets = [0, group_size, draw(st.integers(0, largest)), draw(st.integers(0, largest)), 2**40]
    return GatherCase(local_shard, draw(st.sampled_from(WORKING_DTYPES)), group_size, budgets)


def check_gather(case: GatherCase, *, quantize: bool, unit_numel: int, expected: torch.Tensor):
    element_size = torch.finfo(case.dtype).bits // 8
    shard_numel = case.local_shard.numel()
    # The smallest chunk: one unit (codes + scale, or elements) of this one rank.
    minimal = unit_numel + 4 if quantize else unit_numel * element_size
    for budget in case.budgets:
        plan = plan_gather(
            world_size=1,
            source_numel=shard_numel,
            quantize=quantize,
            group_size=case.group_size,
            unit_numel=unit_numel,
            element_size=element_size,
            budget_bytes=budget,
        )
        # NaN everywhere first: an element the gather does not write fails torch.equal.
        full = torch.full((1, shard_numel), math.nan, dtype=case.dtype)
        stats = gather(plan, case.local_shard, full, rank=0, staging=Staging())
        assert torch.equal(full[0], expected), f"budget {budget} B, {len(plan.chunks)} chunks"
        assert stats.collectives == 0
        assert stats.bytes_sent == 0
        assert stats.peak_staging_bytes == plan.staging_bytes <= max(budget, minimal)


@fewer_examples(2)
@given(case=gather_cases(), exact_unit=st.booleans())
def test_unquantized_gather_is_a_cast_whatever_the_chunking(case, exact_unit):
    """The exact region chunks in units of 1 element, the quantized region with quantization
    off in units of a group; neither changes a value."""
    unit_numel = 1 if exact_unit else case.group_size
    expected = case.local_shard.to(case.dtype)
    check_gather(case, quantize=False, unit_numel=unit_numel, expected=expected)


@fewer_examples(2)
@given(case=gather_cases())
def test_quantized_gather_is_dequantize_of_quantize_whatever_the_chunking(case):
    q = qwz.quantize(case.local_shard, case.group_size)
    expected = qwz.dequantize(q, case.dtype)
    check_gather(case, quantize=True, unit_numel=case.group_size, expected=expected)


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


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_subnormal=False)


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
        optimizer_type="adamw",
        optimizer_params=dict(ADAMW["params"]),
        quantize_weights=quantized,
        group_size=run.group_size,
        preserve_numel=PRESERVE_NUMEL,
        allgather_bucket_size=run.bucket,
        reduce_bucket_size=10,
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


# --------------------------------------------------------------------------- #
# qwz.param_hash
# --------------------------------------------------------------------------- #


class Holder(torch.nn.Module):
    """Parameters registered in a given order, optionally as views into one flat buffer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], *, flat_views: bool = False):
        super().__init__()
        flat = torch.cat([tensor.reshape(-1) for _, tensor in named]) if flat_views else None
        self.flat = flat
        offset = 0
        for name, tensor in named:
            param = torch.nn.Parameter(tensor.clone())
            if flat is not None:
                param.data = flat[offset : offset + tensor.numel()].view(tensor.shape)
                offset += tensor.numel()
            self.register_parameter(name, param)


@st.composite
def named_tensors(draw) -> list[tuple[str, torch.Tensor]]:
    """1 to 5 named fp32 tensors whose values are bf16-representable."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    named = []
    for name, shape in draw(named_shapes(min_dim=1, min_count=1)):
        named.append((name, torch.randn(shape, generator=generator).to(torch.bfloat16).float()))
    return named


@given(named=named_tensors(), data=st.data())
def test_param_hash_ignores_registration_order_and_flat_views(named, data):
    shuffled = data.draw(st.permutations(named))
    plain = Holder(named)
    views = Holder(shuffled, flat_views=True)
    assert views.flat is not None
    flat_storage = views.flat.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat_storage for p in views.parameters())
    assert qwz.param_hash(plain) == qwz.param_hash(views)


@given(named=named_tensors(), data=st.data())
def test_param_hash_changes_with_one_ulp(named, data):
    index = data.draw(st.integers(0, len(named) - 1))
    name, tensor = named[index]
    element = data.draw(st.integers(0, tensor.numel() - 1))
    nudged = tensor.clone().reshape(-1)
    nudged[element] = torch.nextafter(nudged[element], torch.tensor(math.inf))
    changed = [*named[:index], (name, nudged.view(tensor.shape)), *named[index + 1 :]]
    assert qwz.param_hash(Holder(named)) != qwz.param_hash(Holder(changed))


@given(named=named_tensors())
def test_param_hash_tells_bf16_from_fp32_copies(named):
    bf16 = [(name, tensor.to(torch.bfloat16)) for name, tensor in named]
    assert all(torch.equal(a.float(), b) for (_, a), (_, b) in zip(bf16, named, strict=True))
    assert qwz.param_hash(Holder(named)) != qwz.param_hash(Holder(bf16))


# --------------------------------------------------------------------------- #
# qwz.probe.WireProbe
# --------------------------------------------------------------------------- #

PROBED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
)


def dist_functions() -> dict[str, Any]:
    return {name: getattr(dist, name, None) for name in PROBED}


@pytest.fixture
def fake_deepspeed_backend(monkeypatch):
    """DeepSpeed's communication object caches two collectives ([Note: probing DeepSpeed's
    collectives]); a stand-in lets the test check they are re-pointed and restored."""
    backend = types.SimpleNamespace(
        all_gather_function=dist.all_gather_into_tensor,
        reduce_scatter_function=dist.reduce_scatter_tensor,
    )
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", types.SimpleNamespace(cdb=backend))
    return backend


def assert_wrapped(originals: dict[str, Any], backend: types.SimpleNamespace) -> None:
    for name, original in originals.items():
        if original is not None:
            assert getattr(dist, name) is not original, f"{name} is not wrapped"
    assert backend.all_gather_function is dist.all_gather_into_tensor
    assert backend.reduce_scatter_function is dist.reduce_scatter_tensor


def assert_restored(originals: dict[str, Any], backend: types.SimpleNamespace) -> None:
    for name, original in originals.items():
        assert getattr(dist, name, None) is original, f"{name} was not restored"
    assert backend.all_gather_function is originals["all_gather_into_tensor"]
    assert backend.reduce_scatter_function is originals["reduce_scatter_tensor"]


def test_wire_probe_restores_distributed_functions(fake_deepspeed_backend):
    originals = dist_functions()
    with WireProbe():
        assert_wrapped(originals, fake_deepspeed_backend)
    assert_restored(originals, fake_deepspeed_backend)


def test_wire_probe_restores_distributed_functions_after_an_exception(fake_deepspeed_backend):
    """Here the exception is a real one: a collective called without a process group. The
    probe counts the call (before it fails) and still restores everything."""
    originals = dist_functions()
    tensor = torch.zeros(5)
    with pytest.raises((RuntimeError, ValueError)), WireProbe() as probe:
        assert_wrapped(originals, fake_deepspeed_backend)
        dist.all_reduce(tensor)
    assert probe.calls["reduce"] == 1 and probe.bytes["reduce"] == 5 * 4
    assert_restored(originals, fake_deepspeed_backend)


# --------------------------------------------------------------------------- #
# qwz.tolerance: [Note: parameter-sample tolerance]
# --------------------------------------------------------------------------- #


def betas_pairs() -> st.SearchStrategy[tuple[float, float]]:
    return st.one_of(
        st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.0, 0.999), (0.95, 0.9)]),
        # beta2 > 0: with beta2 == 0 the bound is infinite (v_hat is the last g**2 alone).
        st.tuples(floats(0.0, 0.999), floats(0.01, 0.9999)),
    )


@given(betas=betas_pairs())
def test_first_step_bound_is_one(betas):
    assert adam_update_bound(1, betas) == 1.0


def test_bound_is_nondecreasing_in_t_for_default_betas():
    bounds = [adam_update_bound(step, (0.9, 0.999)) for step in range(1, 20_001)]
    regressions = [t + 1 for t in range(len(bounds) - 1) if bounds[t + 1] < bounds[t]]
    assert not regressions, f"C_t decreases after steps {regressions[:5]}"


class GradientSequence(NamedTuple):
    gradients: list[float]
    betas: tuple[float, float]
    tight: bool
    """Built as Cauchy-Schwarz's equality case for the last step: its ratio is C_t."""


@st.composite
def gradient_sequences(draw) -> GradientSequence:
    betas = draw(betas_pairs())
    length = draw(st.integers(1, 60))
    if draw(st.booleans()):
        # g_k proportional to (b1 / b2) ** (t - k) makes m_hat / sqrt(v_hat) exactly C_t.
        beta1, beta2 = betas
        length = min(length, 20)  # (b1 / b2) ** t stays far from overflow
        ratio = beta1 / beta2
        if 0.0 < ratio < 1.0:
            # ... and from underflow: g**2 of the earliest gradient stays a normal float64
            # (a subnormal square loses the precision the equality relies on).
            length = min(length, 1 + int(140 / -math.log10(ratio)))
        scale = draw(floats(1e-3, 1e3)) * draw(st.sampled_from([-1.0, 1.0]))
        if beta1 == 0.0:
            gradients = [0.0] * (length - 1) + [scale]
        else:
            gradients = [scale * (beta1 / beta2) ** (length - k) for k in range(1, length + 1)]
        return GradientSequence(gradients, betas, True)
    # 0, or sign * [1, 10) * 10**e with e in [-30, 6]: g**2 never under- or overflows.
    magnitudes = st.one_of(
        st.just(0.0),
        st.builds(
            lambda sign, mantissa, exponent: sign * mantissa * 10.0**exponent,
            st.sampled_from([-1.0, 1.0]),
            floats(1.0, 10.0),
            st.integers(-30, 6),
        ),
    )
    return GradientSequence(
        draw(st.lists(magnitudes, min_size=length, max_size=length)), betas, False
    )


@given(case=gradient_sequences())
def test_bound_holds_for_adam_moments(case):
    """Adam's bias-corrected moments (eps = 0) computed directly in float64."""
    beta1, beta2 = case.betas
    m = v = 0.0
    ratio = 0.0
    for step, gradient in enumerate(case.gradients, start=1):
        m = beta1 * m + (1 - beta1) * gradient
        v = beta2 * v + (1 - beta2) * gradient * gradient
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        ratio = abs(m_hat) / math.sqrt(v_hat) if v_hat > 0 else 0.0
        bound = adam_update_bound(step, case.betas)
        assert ratio <= bound * (1 + 1e-9), f"step {step}: |m_hat|/sqrt(v_hat) {ratio} > {bound}"
    if case.tight:
        bound = adam_update_bound(len(case.gradients), case.betas)
        assert ratio >= bound * (1 - 1e-9), f"equality case reaches {ratio}, not C_t {bound}"
