"""qwz's ZeRO-1/2 engine on real process groups (gloo on CPU, NCCL with enough GPUs).

Each test names the property it asserts. Training runs are cached per
configuration (``worlds.run_once``, tests/multigpu/conftest.py), so the 2- and
4-rank matrices are trained once and several properties are asserted on the
same trajectories.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import qwz
from qwz.layout import quantized_unit_bytes
from qwz.qualify.run.launch import LocalWorld, RankFailure
from tests.multigpu import models, ranks

pytestmark = pytest.mark.multigpu

STEPS = 20
WORLD_SIZES = (2, 4)
MATRIX = list(itertools.product(WORLD_SIZES, (1, 2), (False, True), ("bf16", "fp32")))
MATRIX_IDS = [f"w{w}-stage{s}-{'q' if q else 'ref'}-{d}" for w, s, q, d in MATRIX]


def _train(worlds, world_size: int, steps: int = STEPS, seed: int = 0, **config) -> list[dict]:
    return worlds.run_once(world_size, ranks.train, ranks.ds_config(**config), steps, seed)


@pytest.mark.parametrize(("world_size", "stage", "quantized", "dtype"), MATRIX, ids=MATRIX_IDS)
def test_losses_and_grad_norms_finite_for_20_steps(worlds, world_size, stage, quantized, dtype):
    results = _train(worlds, world_size, stage=stage, quantized=quantized, dtype=dtype)
    for rank, result in enumerate(results):
        assert len(result["losses"]) == STEPS and len(result["grad_norms"]) == STEPS
        assert all(torch.isfinite(torch.tensor(result["losses"]))), (rank, result["losses"])
        assert all(torch.isfinite(torch.tensor(result["grad_norms"]))), rank
        assert result["stage"] == stage


@pytest.mark.parametrize(("world_size", "stage", "quantized", "dtype"), MATRIX, ids=MATRIX_IDS)
def test_replicas_bit_identical_after_every_step(worlds, world_size, stage, quantized, dtype):
    results = _train(worlds, world_size, stage=stage, quantized=quantized, dtype=dtype)
    for step in range(STEPS):
        hashes = {result["hashes"][step] for result in results}
        assert len(hashes) == 1, f"step {step + 1}: ranks disagree: {hashes}"
    # Training actually moved the weights (a frozen model would pass trivially).
    assert results[0]["hashes"][0] != results[0]["hashes"][-1]


def _single_process_adamw(
    world_size: int, steps: int, clipping: float
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch.optim.AdamW on one process, each step on the concatenation of every
    rank's micro-batch (the mean over it equals the average of the per-rank means).
    Returns the final parameters and the gradient norm before clipping at each step."""
    model = models.build_odd_width_mlp(0)
    # The config sets no weight_decay: DeepSpeed's default, 0 ([Note: DeepSpeed's optimizer
    # defaults], qwz/optimizer.py), not torch's 0.01.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=ranks.LR, betas=ranks.BETAS, eps=REFERENCE_EPS, weight_decay=0.0
    )
    norms = []
    for step in range(steps):
        parts = [models.batch(0, step * 100, rank, torch.float32) for rank in range(world_size)]
        inputs = torch.cat([inputs for inputs, _ in parts])
        targets = torch.cat([targets for _, targets in parts])
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        max_norm = clipping if clipping else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}, norms


# Summation order differs (per-rank means averaged by the reduction vs one mean over the
# concatenated batch), so fp32 gradients differ in the last bits and the nonlinear model
# feeds that back for 20 steps: measured max |difference| 3.6e-7 without and 3.0e-6 with
# clipping (2 ranks). A lost or repeated step, a wrong shard or a stale gather moves
# weights by ~lr = 1e-3, so 1e-5 is tight. Adam is nearly blind to a constant gradient
# scale, so the gradient norm (which a wrong average changes by the world size) is checked
# too, at 1e-5 relative.
REFERENCE_ATOL = 1e-5
NORM_RTOL = 1e-5
# Adam divides by |g| + eps: an element whose gradient cancels to ~1e-8 (rounding level)
# gets an update anywhere in [-lr, lr] depending on the last bits. eps = 1e-5 keeps such
# rounding-level gradient differences (measured up to ~6e-9) at <= 1e-3 * lr: well-posed.
REFERENCE_EPS = 1e-5


@pytest.mark.parametrize("clipping", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unquantized_fp32_matches_single_process_adamw(worlds, world_size, stage, clipping):
    results = _train(
        worlds,
        world_size,
        stage=stage,
        quantized=False,
        dtype="fp32",
        clipping=clipping,
        eps=REFERENCE_EPS,
    )
    expected, norms = _single_process_adamw(world_size, STEPS, clipping)
    for name, value in expected.items():
        got = results[0]["final_params"][name]
        torch.testing.assert_close(got, value, rtol=0, atol=REFERENCE_ATOL, msg=name)
    for result in results:
        assert result["grad_norms"] == pytest.approx(norms, rel=NORM_RTOL)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_quantized_within_parameter_sample_tolerance(worlds, world_size, stage, dtype):
    """Zero violations of [Note: parameter-sample tolerance] (qwz/qualify/evidence/tolerance.py) at
    every step, and the master shard is never quantized: after step 1 (identical start, identical
    gradients) the candidate's master equals the reference's bit for bit, and it is not on
    the int8 grid of its own groups."""
    results = worlds.get(world_size).run(ranks.compare_arms, stage, dtype, STEPS)
    for rank, result in enumerate(results):
        assert result["checked"] > 0
        assert result["violations"] == 0, (rank, result)
        assert result["master_equal_after_step1"], rank
        assert result["master_on_grid"] is False, rank
        assert result["final_hashes"][0] != result["final_hashes"][1]


def test_identical_runs_give_identical_final_hashes(worlds):
    config = dict(stage=2, quantized=True, dtype="bf16")
    first = worlds.get(2).run(ranks.train, ranks.ds_config(**config), 5, 0)
    second = worlds.get(2).run(ranks.train, ranks.ds_config(**config), 5, 0)
    assert [r["hashes"][-1] for r in first] == [r["hashes"][-1] for r in second]


def test_group_sizes_64_and_8192_give_different_hashes_and_each_rank_reports_its_own(worlds):
    by_group = {
        group: _train(worlds, 4, steps=5, stage=2, quantized=True, dtype="bf16", group_size=group)
        for group in (64, 8192)
    }
    for group, results in by_group.items():
        assert [r["group_size"] for r in results] == [group] * 4
    assert by_group[64][0]["hashes"][-1] != by_group[8192][0]["hashes"][-1]
    reference = _train(worlds, 4, steps=5, stage=2, quantized=False, dtype="bf16")
    assert [r["group_size"] for r in reference] == [None] * 4


@pytest.mark.parametrize("group_size", [64, 8192])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_wire_bytes_of_the_quantized_gather(worlds, world_size, group_size):
    """Bytes counted by wrapping torch.distributed: the quantized region sends 1 + 4/G bytes
    per element instead of 2, the exact region its bf16 bytes, and nothing else."""
    config = dict(stage=2, dtype="bf16", group_size=group_size)
    candidate = _train(worlds, world_size, steps=3, quantized=True, **config)
    reference = _train(worlds, world_size, steps=3, quantized=False, **config)
    regions = candidate[0]["regions"]
    quantized_shard = regions["quantized"]["shard_numel"]
    exact_shard = regions["exact"]["shard_numel"]
    expected_candidate = quantized_shard * (1 + 4 / group_size) + exact_shard * 2
    expected_reference = (quantized_shard + exact_shard) * 2
    for rank in range(world_size):
        sent = candidate[rank]["gather_bytes"][-1]
        # [Note: wire row]: each collective's row is padded to 4 bytes, at most 3 bytes.
        calls = candidate[rank]["gather_calls"][-1]
        assert expected_candidate <= sent < expected_candidate + 4 * calls
        assert reference[rank]["gather_bytes"][-1] == expected_reference
        reported = candidate[rank]["reported"][-1]
        assert sum(stats["bytes_sent"] for stats in reported.values()) == sent
    # The ratio on the quantized region alone is exactly (1 + 4/G) / 2; the model-level
    # ratio adds the exact region and padding.
    quantized_only = quantized_shard * (1 + 4 / group_size) / (quantized_shard * 2)
    assert quantized_only == pytest.approx((1 + 4 / group_size) / 2, rel=1e-12)
    exact_share = exact_shard * 2 / expected_reference
    ratio = candidate[0]["gather_bytes"][-1] / reference[0]["gather_bytes"][-1]
    padding = 4 * candidate[0]["gather_calls"][-1] / expected_reference
    assert ratio <= (1 + 4 / group_size) / 2 + exact_share + padding
    print(f"w{world_size} G={group_size}: quantized/bf16 gather bytes = {ratio:.4f}")


def _staging_limit(bucket: int, world_size: int, group_size: int) -> int:
    """[Note: staging bound]: both staging buffers together within bucket elements of bf16,
    but at least one minimal chunk: one group per rank plus one exact bf16 element, the row
    padded to 4 bytes ([Note: wire row])."""
    minimal_row_bytes = -(-(quantized_unit_bytes(group_size) + 2) // 4) * 4
    return max(bucket * 2, world_size * minimal_row_bytes)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_staging_never_exceeds_the_bound_and_chunking_never_changes_values(worlds, world_size):
    group_size = 64
    buckets = [1, world_size * group_size // 2, world_size * group_size, 20_000, 10**9]
    final_hashes = set()
    calls = []
    for bucket in buckets:
        # preserve_numel 1000 keeps the exact region to the 836 bias and norm
        # elements, so even one element per rank per chunk stays a few hundred calls.
        results = _train(
            worlds,
            world_size,
            steps=3,
            stage=1,
            quantized=True,
            dtype="bf16",
            bucket=bucket,
            preserve=1000,
        )
        limit = _staging_limit(bucket, world_size, group_size)
        for result in results:
            assert result["largest_gather_output_bytes"] <= limit, (bucket, limit)
            for reported in result["reported"]:
                for stats in reported.values():
                    assert stats["peak_staging_bytes"] <= limit
        final_hashes.add(results[0]["hashes"][-1])
        calls.append(results[0]["gather_calls"][-1])
    # Quantization is per group, so chunk boundaries must not change a single bit.
    assert len(final_hashes) == 1
    # Small buckets really do cut the shard into many chunks; a huge one sends the whole
    # model in one collective (the exact region rides in the quantized region's rows).
    assert calls[0] > calls[-1] == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_padding_edge_cases_world4_every_parameter_quantized(worlds, stage):
    """World size 4, preserve_numel 0: the 3-element bias (smaller than one group and than
    the world size) and every other parameter go through the quantized gather; the region's
    length is divisible by neither 4 nor 64."""
    results = _train(worlds, 4, steps=5, stage=stage, quantized=True, dtype="bf16", preserve=0)
    region = results[0]["regions"]["quantized"]
    assert "exact" not in results[0]["regions"]
    assert region["numel"] % 4 and region["numel"] % 64
    assert region["shard_numel"] % 64 == 0 and 4 * region["shard_numel"] >= region["numel"]
    for step in range(5):
        assert len({r["hashes"][step] for r in results}) == 1
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
    bias = results[0]["final_params"]["head.bias"]
    assert bias.shape == (3,) and torch.isfinite(bias).all()


def test_gradient_accumulation_steps_only_every_kth_call(worlds):
    results = _train(worlds, 2, steps=4, stage=2, quantized=True, dtype="bf16", accumulation=3)
    for result in results:
        assert len(result["losses"]) == 12 and len(result["grad_norms"]) == 4
    assert len({r["hashes"][-1] for r in results}) == 1


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("gradient", "non-finite gradient"),
        ("weight", "non-finite working weights: mid.weight (rank 0)"),
        ("update", "non-finite updated weight"),
    ],
)
def test_non_finite_raises_on_every_rank_with_step_and_parameter(worlds, kind, expected):
    bad_rank = 0 if kind == "weight" else 1
    results = worlds.get(2).run(ranks.non_finite, kind, bad_rank, 3)
    messages = {result["message"] for result in results}
    assert len(messages) == 1, messages  # every rank raised the same error
    message = messages.pop()
    assert message is not None and message.startswith("step 3:"), message
    assert expected in message
    names = {"gradient": "norm.bias", "weight": "mid.weight", "update": "up.weight"}
    assert names[kind] in message
    for result in results:
        assert result["hash_after"] == result["hash_before"], "a replica was half-updated"


def test_dead_rank_fails_fast_instead_of_hanging():
    with LocalWorld(2, timeout_s=120) as world, pytest.raises(RankFailure) as failure:
        world.run(ranks.die_at_step, 1, 2)
    text = str(failure.value)
    assert "rank 1" in text and "exit code 17" in text


@pytest.mark.parametrize("stage", [1, 2])
def test_initialize_makes_every_replica_rank0s_exactly(worlds, stage):
    hashes = worlds.get(4).run(ranks.initial_replicas, stage)
    assert hashes == [qwz.param_hash(models.build_odd_width_mlp(seed=0))] * 4


@pytest.mark.parametrize("stage", [1, 2])
def test_owner_decodes_its_master_within_half_a_scale(worlds, stage):
    """[Note: quantization math] on the wire, against the fp32 master: every element of every
    rank's own shard decodes to within scale / 2 (scale = group absmax / 127) of its master
    value. The parameter-sample tolerance is dominated by the Adam drift term (~2 lr), so it
    cannot see a wrong scale (absmax / 128 puts a group's largest element a full scale off)."""
    results = worlds.get(2).run(ranks.own_shard_decode_error, stage)
    for rank, result in enumerate(results):
        assert result["worst_ratio"] <= 1.0, (rank, result)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_are_reduced_in_deepspeeds_dtype_for_the_same_config(worlds, stage):
    """DeepSpeed's ZeRO-1/2 reduces in `communication_data_type`, else the working dtype:
    bf16 moves half the bytes of fp32, and the key switches it."""
    bf16 = ranks.ds_config(stage=stage, quantized=True, dtype="bf16")
    fp32_comm = {**bf16, "communication_data_type": "fp32"}
    by_dtype = {
        name: worlds.get(2).run(ranks.reduction_bytes, config)
        for name, config in (("bf16", bf16), ("fp32", fp32_comm))
    }
    for name, element_bytes in (("bf16", 2), ("fp32", 4)):
        for result in by_dtype[name]:
            assert result["reduce_dtype"] == f"torch.{'bfloat16' if name == 'bf16' else 'float32'}"
            # Every padded gradient element once, plus two scalars: the sum of squares for the
            # norm (float64, see optimizer._sum_of_squares) and the fp32 count of non-finite
            # updated weights.
            expected = result["padded_numel"] * element_bytes + 8 + 4
            assert result["reduce_bytes"] == expected, (name, result)
