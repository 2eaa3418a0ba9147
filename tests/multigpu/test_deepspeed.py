"""DeepSpeed's own ZeRO-1/2 optimizer with qwz's quantized weight gather (qwz.integrations).

Real DeepSpeed engines on real process groups (gloo on CPU, 2 and 4 ranks), a
tiny MLP whose two large Linears are quantized and whose biases, LayerNorm and
head travel exactly (see ``models.DeepSpeedLayoutMLP``). Runs are cached per
configuration (``worlds.run_once``), so several properties are asserted on one
trajectory.

Tolerance against stock DeepSpeed (``test_matches_stock_deepspeed_within_bound``):
both engines start from bit-identical weights and see identical batches, so the
first forward, backward and optimizer step are identical and the fp32 masters
are still equal after step 1 (asserted). The working copies then differ only by
the gather: qwz decodes within ``scale / 2`` of the master ([Note: quantization
math]) and each side rounds once to the working dtype, so after step 1 every
element satisfies ``|w_qwz - w_stock| <= scale / 2 + half_ulp(w_stock) +
half_ulp(w_qwz)``, with ``scale = 0`` for exactly-sent elements, which must be
bit-identical. From step 2 on the gradients differ, and each Adam(W) step moves
an element by at most ``lr * C_t`` in either run (``C_t`` from Cauchy-Schwarz on
Adam's two moving averages, ``C_1 = 1``; decoupled weight decay only shrinks
differences), so the masters drift apart by at most ``2 * lr * sum_k C_k``. That
is ``qwz.qualify.evidence.tolerance.element_bound`` ([Note: parameter-sample tolerance]), checked
on every element of every partition after every step: zero violations allowed.

Parity with qwz's own engine (``test_parity_*``): ``qwz.initialize`` and
DeepSpeed run side by side on the same DeepSpeedLayoutMLP, seed, batches and AdamW
(``torch_adam``, so both step ``torch.optim.AdamW``), and every element of every
parameter is compared after every step. The two are different implementations
of the same algorithm: they agree on the first forward bit for bit (asserted),
but reduce gradients in a different order and precision (DeepSpeed reduces bf16
gradients in bf16, qwz in fp32) and run AdamW over differently shaped masters,
so later steps differ by rounding that Adam's normalisation can amplify up to a
full update (an element whose gradient is rounding noise may move by ``+lr``
in one run and ``-lr`` in the other). Even in fp32 with 2 ranks, where qwz's
first step equals single-process AdamW bit for bit, DeepSpeed's differs in the
last bits of most elements and by up to ``lr / 3`` where the two ranks'
gradients cancel (measured while writing these tests). The only bound that holds for *any* two
gradient sequences is the Adam drift bound above, so that is the tolerance:
``element_bound`` with ``scale = 0`` when neither side quantizes, and with the
sum of both sides' group scales when both quantize with the same G (their
groups are cut differently: qwz packs large parameters into their own region,
DeepSpeed + qwz quantizes DeepSpeed's mixed partitions). Zero violations are
allowed; the worst element reaches 0.99 of the bound in bf16 with 4 ranks, so
the bound is tight, not decorative. What Adam's scale invariance hides, the
gradient norm shows: after step 1, from identical weights, the global gradient
norms agree to 1e-6 relative in fp32 (measured: equal) and to ``(W - 1) *
2**-9`` in bf16 (one bf16 rounding per partial sum in DeepSpeed's reduction;
measured: 6.4e-5 at W=4), so a missing or doubled averaging would fail.

Wire bytes (``test_weight_gather_wire_bytes``): per rank and step qwz sends
``P_pad * (1 + 4/G)`` (``P`` rounded up to whole groups) plus the exact stream
(the longest rank's small-parameter elements, 2 bytes each in bf16), against
``2 * P`` for stock bf16; the test asserts that formula to the byte. Measured
ratios on this model (ideal ``(1 + 4/G) / 2``: 0.531 at G=64, 0.500 at 8192):

    world 2 (P = 101,300): G=64 0.552, G=8192 0.546
    world 4 (P =  50,650): G=64 0.562, G=8192 0.597

The excess is group padding (a partition of 50,650 elements is only 6.2 groups
of 8192, padded to 7: +13%) and the exact stream (up to 1,527 elements on one
rank); on a real model both are a rounding error.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json

import pytest
import torch

deepspeed = pytest.importorskip(
    "deepspeed", reason="the DeepSpeed integration tests need deepspeed (pip install .[deepspeed])"
)

import qwz  # noqa: E402
from qwz.config import DEFAULT_PRESERVE_NUMEL, QuantizedWeights  # noqa: E402
from qwz.integrations import deepspeed as qwz_deepspeed  # noqa: E402
from qwz.layout import quantized_unit_bytes  # noqa: E402
from tests.multigpu import deepspeed_ranks as ranks  # noqa: E402

pytestmark = [pytest.mark.multigpu]

STEPS = 12
BF16_BYTES = 2

TRAINING = [
    (2, 1, "bf16"),
    (2, 2, "bf16"),
    (4, 1, "bf16"),
    (4, 2, "bf16"),
    (2, 2, "fp32"),
    (4, 1, "fp32"),
]
MEASURED_RATIOS = {(2, 64): 0.552, (2, 8192): 0.546, (4, 64): 0.562, (4, 8192): 0.597}
"""Rank 0's gathered / stock bf16 bytes per step on DeepSpeedLayoutMLP (module docstring)."""

TRAINING_IDS = [f"w{w}-stage{s}-{d}" for w, s, d in TRAINING]


@pytest.fixture(scope="module")
def ds_worlds(worlds):
    """The session's local process groups (tests/multigpu/conftest.py)."""
    return worlds


def _train(ds_worlds, world_size: int, steps: int = STEPS, run: int = 0, **options) -> list[dict]:
    """Per-rank results of ``deepspeed_ranks.train``; `run` distinguishes deliberate reruns."""
    qwz_gather = options.pop("qwz_gather", None)
    config = ranks.ds_config(**options)
    return ds_worlds.run_once(
        world_size, ranks.train, config, steps, qwz_gather=qwz_gather, rerun=run
    )


def _expected_qwz_bytes(result: dict, world_size: int, group_size: int, element_size: int) -> int:
    """Bytes one rank puts on the wire per step, from first principles (module docstring)."""
    total = 0
    for partition_numel, exact_counts in zip(
        result["partition_numels"], result["exact_counts"], strict=True
    ):
        padded = -(-partition_numel // group_size) * group_size
        total += padded // group_size * quantized_unit_bytes(group_size)
        total += max(exact_counts) * element_size
    return total


# --------------------------------------------------------------------------- #
# Config handling and refusals: no process group needed, DeepSpeed is never reached
# --------------------------------------------------------------------------- #


def _config(**zero) -> dict:
    config = ranks.ds_config(stage=zero.pop("stage", 2), group_size=64)
    config["zero_optimization"].update(zero)
    return config


REFUSALS = [
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
    ({"offload_param": {"device": "nvme"}}, "offload_param"),
    ({"cpu_offload": True}, "cpu_offload"),
    ({"zenflow": {"topk_ratio": 0.1}}, "zenflow"),
    ({"stage": 3, "zero_quantized_weights_group_size": 128}, "stage 3 supports only"),
    ({"stage": 3, "zero_quantized_weights_preserve_numel": 10}, "only qwz's stage 1/2"),
    ({"stage": 0}, "needs ZeRO stage 1, 2 or 3"),
    ({"zero_quantized_weights_group_size": 12}, "positive multiple of 8"),
    ({"zero_quantized_weights_group_size": True}, "a bool is not an integer"),
    ({"zero_quantized_weights_preserve_numel": -1}, "non-negative"),
]


@pytest.mark.parametrize(("zero", "message"), REFUSALS, ids=[m for _, m in REFUSALS])
def test_unsupported_configurations_are_refused_with_config_error(zero, message):
    with pytest.raises(qwz.ConfigError, match=message):
        qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(**zero))


def test_switched_off_offload_and_zenflow_are_not_refused(monkeypatch):
    captured = _capture_deepspeed(monkeypatch)
    config = _config(
        offload_optimizer={"device": "none"}, offload_param={"device": "none"}, zenflow=None
    )
    qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert captured["config"]["zero_optimization"]["offload_optimizer"] == {"device": "none"}


def test_bf16_stage1_with_fp32_grad_accumulation_is_refused():
    config = _config(stage=1)
    config["data_types"] = {"grad_accum_dtype": "fp32"}
    with pytest.raises(qwz.ConfigError, match="BF16_Optimizer"):
        qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.19.0", "dev"])
def test_unsupported_deepspeed_version_is_refused(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(qwz.ConfigError, match=r"supported: >=0\.19, <0\.20"):
        qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config())


def test_installed_deepspeed_is_in_the_supported_range():
    low, high = qwz_deepspeed.SUPPORTED_DEEPSPEED
    assert low <= qwz_deepspeed._version_tuple(deepspeed.__version__) < high


def test_only_deepspeeds_zero_optimizer_is_taken_over():
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(qwz.ConfigError, match="DeepSpeedZeroOptimizer"):
        qwz_deepspeed.takeover._take_over(other, QuantizedWeights(enabled=True))


class _FakeEngine:
    optimizer = None


def _capture_deepspeed(monkeypatch) -> dict:
    """Replace deepspeed.initialize by a recorder and the takeover by a no-op recorder."""
    captured: dict = {}
    real = deepspeed.initialize
    signature = inspect.signature(real)

    @functools.wraps(real)
    def fake_initialize(*args, **kwargs):
        captured.update(signature.bind(*args, **kwargs).arguments)
        return (_FakeEngine(), None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    monkeypatch.setattr(
        qwz_deepspeed.takeover,
        "_take_over",
        lambda optimizer, requested, **kernels: captured.update(took=requested),
    )
    monkeypatch.setattr(qwz_deepspeed.takeover.resume, "attach", lambda engine: None)
    return captured


def test_qwz_keys_are_validated_then_stripped_and_the_takeover_requested(monkeypatch):
    captured = _capture_deepspeed(monkeypatch)
    config = _config(zero_quantized_weights_group_size=128)
    before = json.dumps(config, sort_keys=True)
    result = qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    zero = captured["config"]["zero_optimization"]
    assert not {k for k in zero if k.startswith("zero_quantized_weights")}, zero
    assert captured["took"] == QuantizedWeights(True, 128, DEFAULT_PRESERVE_NUMEL)
    assert isinstance(result[0], _FakeEngine) and len(result) == 4
    assert json.dumps(config, sort_keys=True) == before, "the caller's config was mutated"


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_takeover_can_be_disabled_keeping_the_request_for_stock_deepspeed(monkeypatch, how):
    captured = _capture_deepspeed(monkeypatch)
    kwargs = {}
    if how == "argument":
        kwargs["qwz_gather"] = False
    else:
        monkeypatch.setenv(qwz_deepspeed.GATHER_ENV, "0")
    qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(), **kwargs)
    zero = captured["config"]["zero_optimization"]
    assert zero["zero_quantized_weights"] is True
    assert "zero_quantized_weights_group_size" not in zero
    assert "took" not in captured


def test_stage3_keeps_deepspeeds_own_qwz_and_is_not_taken_over(monkeypatch):
    captured = _capture_deepspeed(monkeypatch)
    qwz_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(stage=3))
    zero = captured["config"]["zero_optimization"]
    assert zero["zero_quantized_weights"] is True
    assert "zero_quantized_weights_group_size" not in zero
    assert "took" not in captured


def test_config_from_args_deepspeed_config_file(monkeypatch, tmp_path):
    captured = _capture_deepspeed(monkeypatch)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(zero_quantized_weights_group_size=8192)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    qwz_deepspeed.initialize(args, torch.nn.Linear(2, 2))
    assert captured["args"].deepspeed_config is None
    assert args.deepspeed_config == str(path), "the caller's args were mutated"
    assert captured["took"].group_size == 8192
    assert "zero_quantized_weights_group_size" not in captured["config"]["zero_optimization"]


def test_plan_of_a_small_parameter_straddling_two_partitions():
    # Flat buffer of 3 ranks x 10 elements: a large parameter [0, 14), a small one [14, 23)
    # that straddles ranks 1 and 2, and a small one [23, 30).
    plan = qwz_deepspeed.plan_flat_group(
        [(0, 14), (14, 9), (23, 7)],
        10,
        rank=1,
        world_size=3,
        process_group=None,
        group_size=8,
        preserve_numel=9,
        bucket_bytes=2 * 3 * (2 * quantized_unit_bytes(8) + 10 * 2),
        element_size=2,
    )
    assert [p.tolist() for p in plan.exact_positions] == [[], [4, 5, 6, 7, 8, 9], list(range(10))]
    assert plan.exact_runs == ((), ((4, 10),), ((0, 10),))
    # 10 elements = 2 groups of 8 (the second zero-padded), in one chunk: the budget holds
    # two rows of 2 scales + 16 codes + 10 exact elements (rank 2's) per rank, not two chunks.
    (chunk,) = plan.gather_plan.chunks
    assert (chunk.start, chunk.end, chunk.row.num_groups, chunk.row.exact_numel) == (0, 10, 2, 10)
    # Rank 1's group 0 holds quantized [0, 4) and exact [4, 8): re-encoded with the exact
    # ones zeroed; group 1 is exact up to the partition's end (and padding): not masked.
    (masked,) = plan.masked
    assert masked.group_index.tolist() == [0]
    assert masked.keep.tolist() == [[True] * 4 + [False] * 4]


# --------------------------------------------------------------------------- #
# Training with the takeover
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("world_size", "stage", "dtype"), TRAINING, ids=TRAINING_IDS)
def test_losses_and_grad_norms_finite_with_the_group_size_in_force(
    ds_worlds, world_size, stage, dtype
):
    results = _train(ds_worlds, world_size, stage=stage, dtype=dtype, group_size=64)
    for rank, result in enumerate(results):
        assert result["optimizer"] == "DeepSpeedZeroOptimizer"
        assert result["working_dtype"] == str(ranks.DTYPES[dtype])
        assert len(result["losses"]) == STEPS
        assert all(torch.isfinite(torch.tensor(result["losses"]))), (rank, result["losses"])
        assert all(torch.isfinite(torch.tensor(result["grad_norms"]))), rank
        assert result["group_size"] == 64, rank


@pytest.mark.parametrize(("world_size", "stage", "dtype"), TRAINING, ids=TRAINING_IDS)
def test_replicas_bit_identical_after_every_step(ds_worlds, world_size, stage, dtype):
    results = _train(ds_worlds, world_size, stage=stage, dtype=dtype, group_size=64)
    for step in range(STEPS):
        hashes = {result["hashes"][step] for result in results}
        assert len(hashes) == 1, f"step {step + 1}: ranks disagree: {hashes}"
    assert results[0]["hashes"][0] != results[0]["hashes"][-1], "training did not move weights"


@pytest.mark.parametrize(("world_size", "stage", "dtype"), TRAINING, ids=TRAINING_IDS)
def test_every_step_gathers_the_decoded_master_through_qwz(ds_worlds, world_size, stage, dtype):
    results = _train(ds_worlds, world_size, stage=stage, dtype=dtype, group_size=64)
    for rank, result in enumerate(results):
        for step, check in enumerate(result["checks"], start=1):
            assert check["qwz_gathers"] == 1 and check["in_effect"], (rank, step, check)
            reported = result["reported_stats"][step - 1]
            assert reported["bytes_sent"] == check["gathered_bytes"], (rank, step)
        # Independently recomputed with qwz.quantize from this rank's fp32 master.
        assert all(result["decode_matches"]), f"rank {rank}: own partition != decode of master"


def deepspeed_fp16_missing() -> str | None:
    """Why DeepSpeed would refuse fp16 on this machine, or None when it accepts it.

    DeepSpeed's engine raises "Type fp16 is not supported on your device" exactly when
    ``get_accelerator().is_fp16_supported()`` is falsy (``_do_sanity_check``); its CPU
    accelerator answers through oneDNN, which has fp16 only on CPUs with AVX512-FP16 or
    AMX-FP16. Ask the same question, so the test skips exactly where DeepSpeed refuses."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return None
    return (
        f"Type fp16 is not supported on your device: DeepSpeed's {accelerator.device_name()} "
        "accelerator reports no fp16 (is_fp16_supported() is falsy; on CPU oneDNN needs "
        "AVX512-FP16 or AMX-FP16)"
    )


def test_fp16_probe_agrees_with_deepspeeds_own_refusal(monkeypatch):
    """The skip below must follow DeepSpeed's check, not a guess: with the accelerator's
    answer forced either way, the probe and DeepSpeed's sanity check agree."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    class PrecisionChecksPassed(Exception):
        """Raised by the fake engine at the first check after the precision ones."""

    def precision_checks_passed() -> None:
        raise PrecisionChecksPassed

    accelerator = get_accelerator()
    fake = argparse.Namespace(
        fp16_enabled=lambda: True,
        bfloat16_enabled=lambda: False,
        _assert_valid_mixed_precision_config=precision_checks_passed,
    )
    for supported in (True, False):
        monkeypatch.setattr(accelerator, "is_fp16_supported", lambda value=supported: value)
        refused = None
        try:
            DeepSpeedEngine._do_sanity_check(fake)
        except ValueError as error:
            refused = str(error)
        except PrecisionChecksPassed:
            pass
        missing = deepspeed_fp16_missing()
        assert (refused is None) == (missing is None), (supported, refused, missing)
        if refused is not None:
            assert missing is not None and missing.startswith(refused.rstrip("."))


def test_fp16_overflow_steps_skip_the_gather_and_later_steps_use_it(ds_worlds):
    missing = deepspeed_fp16_missing()
    if missing is not None:
        pytest.skip(missing)
    # 2**24 loss scale: the first steps overflow in fp16 and DeepSpeed skips them (no
    # gather at all, which must not be mistaken for a missing takeover), then it backs off.
    results = _train(ds_worlds, 2, stage=2, dtype="fp16", group_size=64, initial_scale_power=24)
    for rank, result in enumerate(results):
        assert result["working_dtype"] == "torch.float16"
        gathered = [check["qwz_gathers"] for check in result["checks"]]
        assert gathered[0] == 0 and gathered[-1] == 1, (rank, gathered)
        skipped = [check for check in result["checks"] if check["qwz_gathers"] == 0]
        assert all(check["gathered_bytes"] == 0 for check in skipped)
        assert all(check["in_effect"] for check in result["checks"] if check["qwz_gathers"])
        # Until the first gather the working copy is the model's initial weights.
        first = gathered.index(1)
        assert result["decode_matches"][first:] == [True] * (STEPS - first), (rank, first)
        assert not any(result["decode_matches"][:first]), (rank, first)
        assert all(torch.isfinite(torch.tensor(result["losses"])))
    for step in range(STEPS):
        assert len({result["hashes"][step] for result in results}) == 1, step + 1
    assert results[0]["hashes"][0] != results[0]["hashes"][-1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_partitions_are_not_multiples_of_the_group_size(ds_worlds, world_size):
    for group_size in (64, 8192):
        results = _train(ds_worlds, world_size, stage=2, group_size=group_size)
        (partition_numel,) = results[0]["partition_numels"]
        assert partition_numel % group_size, (world_size, group_size, partition_numel)
        assert all(all(result["decode_matches"]) for result in results)
        assert len({result["hashes"][-1] for result in results}) == 1


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("group_size", [64, 8192])
def test_weight_gather_wire_bytes(ds_worlds, world_size, group_size):
    results = _train(ds_worlds, world_size, stage=2, group_size=group_size)
    ideal = (1 + 4 / group_size) / 2
    for rank, result in enumerate(results):
        expected = _expected_qwz_bytes(result, world_size, group_size, BF16_BYTES)
        for check in result["checks"]:
            # [Note: wire row]: one collective here, its row padded to 4 bytes (< 4 bytes).
            assert expected <= check["gathered_bytes"] < expected + 4, (rank, check, expected)
            assert check["unquantized_bytes"] == result["partition_numels"][0] * BF16_BYTES
            ratio = check["gathered_bytes"] / check["unquantized_bytes"]
            assert ratio >= ideal, (rank, ratio, ideal)
    measured = (
        results[0]["checks"][0]["gathered_bytes"] / results[0]["checks"][0]["unquantized_bytes"]
    )
    assert round(measured, 3) == MEASURED_RATIOS[world_size, group_size], measured


def test_preserve_numel_above_every_parameter_reproduces_stock_bit_for_bit(ds_worlds):
    everything_exact = _train(ds_worlds, 2, stage=2, group_size=64, preserve=10**9)
    stock = _train(ds_worlds, 2, stage=2, quantized=False)
    assert [r["hashes"] for r in everything_exact] == [r["hashes"] for r in stock]
    for result in everything_exact:
        for check in result["checks"]:
            # Only the exact stream moves: the longest rank's partition, as stock sends it.
            assert check["qwz_gathers"] == 1
            assert check["gathered_bytes"] == check["unquantized_bytes"]


def test_preserve_numel_zero_quantizes_every_parameter(ds_worlds):
    group_size = 64
    results = _train(ds_worlds, 2, stage=2, group_size=group_size, preserve=0)
    assert len({r["hashes"][-1] for r in results}) == 1
    for result in results:
        assert all(result["decode_matches"])
        padded = -(-result["partition_numels"][0] // group_size) * group_size
        expected = padded // group_size * quantized_unit_bytes(group_size)
        assert all(check["gathered_bytes"] == expected for check in result["checks"])


@pytest.mark.parametrize(
    ("world_size", "stage", "dtype"), [(2, 2, "bf16"), (4, 1, "bf16"), (2, 1, "fp32")]
)
def test_matches_stock_deepspeed_within_bound(ds_worlds, world_size, stage, dtype):
    results = ds_worlds.get(world_size).run(ranks.compare_with_stock, stage, dtype, STEPS)
    for rank, result in enumerate(results):
        assert result["masters_equal_after_step1"], rank
        assert result["exact_equal_after_step1"], rank
        assert result["step1_violations"] == 0, (rank, result)
        assert result["violations"] == 0, (rank, result)
        assert result["max_error"] > 0, "no difference at all: was anything quantized?"
        stock_hash, qwz_hash = result["final_hashes"]
        assert stock_hash != qwz_hash


def test_identical_runs_give_identical_final_hashes(ds_worlds):
    first = _train(ds_worlds, 2, stage=2, group_size=64)
    second = _train(ds_worlds, 2, stage=2, group_size=64, run=1)
    assert [r["hashes"] for r in first] == [r["hashes"] for r in second]


def test_group_sizes_64_and_8192_differ_and_every_rank_reports_its_own(ds_worlds):
    for world_size in (2, 4):
        small = _train(ds_worlds, world_size, stage=2, group_size=64)
        large = _train(ds_worlds, world_size, stage=2, group_size=8192)
        assert [r["group_size"] for r in small] == [64] * world_size
        assert [r["group_size"] for r in large] == [8192] * world_size
        assert small[0]["hashes"][-1] != large[0]["hashes"][-1]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket", [64, 1000, 5e8], ids=["below-one-group", "small", "large"])
def test_staging_bound_respected(ds_worlds, world_size, bucket):
    group_size = 64
    results = _train(ds_worlds, world_size, steps=2, stage=2, group_size=group_size, bucket=bucket)
    bucket_bytes = int(bucket) * BF16_BYTES
    # [Note: staging bound]: at least one group per rank, plus the exact elements inside it
    # (at most a group's worth of bf16), the row padded to 4 bytes ([Note: wire row]).
    one_group = world_size * quantized_unit_bytes(group_size)
    minimum_bytes = world_size * (-(-(quantized_unit_bytes(group_size) + group_size * 2) // 4) * 4)
    flat_bytes = world_size * results[0]["partition_numels"][0] * BF16_BYTES
    for rank, result in enumerate(results):
        assert result["allgather_bucket_size"] == int(bucket)
        for check in result["checks"]:
            largest = check["largest_gather_output_bytes"]
            assert largest <= max(bucket_bytes, minimum_bytes), (rank, largest, bucket_bytes)
            if bucket == 64:  # the one-group-per-rank minimum, by design
                assert one_group <= largest <= minimum_bytes
            if bucket == 5e8:
                assert largest < flat_bytes  # one chunk, and still smaller than stock's gather
            assert check["in_effect"]
        assert all(result["decode_matches"]), rank
    # Chunking never changes values: the same run with any bucket size ends identically.
    reference = _train(ds_worlds, world_size, steps=2, stage=2, group_size=group_size, bucket=5e8)
    assert results[0]["hashes"] == reference[0]["hashes"]


# --------------------------------------------------------------------------- #
# Stock behaviour stays available and detectable
# --------------------------------------------------------------------------- #


def test_disabled_takeover_is_stock_and_detected_as_not_in_effect(ds_worlds):
    disabled = _train(ds_worlds, 2, stage=2, group_size=64, qwz_gather=False)
    unrequested = _train(ds_worlds, 2, stage=2, quantized=False)
    for result in disabled:
        assert result["group_size"] is None
        for check in result["checks"]:
            assert check["gathered_bytes"] == check["unquantized_bytes"] > 0
            assert check["qwz_gathers"] == 0 and not check["in_effect"]
        fields = qwz_deepspeed.WeightGatherCheck._fields
        check = qwz_deepspeed.WeightGatherCheck(**{k: result["checks"][0][k] for k in fields})
        with pytest.raises(RuntimeError, match="quantized weights requested but not in effect"):
            qwz_deepspeed.require_quantized_weights(check)
    # DeepSpeed silently ignores zero_quantized_weights at stage 2: bit-identical to not asking.
    assert [r["hashes"] for r in disabled] == [r["hashes"] for r in unrequested]


def test_plain_deepspeed_initialize_in_the_same_process_stays_stock(ds_worlds):
    for result in ds_worlds.get(2).run(ranks.plain_engine_stays_stock):
        assert result["module_gather_restored"]
        assert result["plain_step_is_class_step"] and result["qwz_step_is_replaced"]
        assert result["plain_has_no_group_size"]
        for check in result["checks"]["plain"]:
            assert check["gathered_bytes"] == check["unquantized_bytes"] > 0
            assert not check["in_effect"]
        for check in result["checks"]["qwz"]:
            assert check["in_effect"] and check["gathered_bytes"] < check["unquantized_bytes"]


def test_wire_probe_sees_deepspeeds_cached_gather(ds_worlds):
    for result in ds_worlds.get(2).run(ranks.probe_sees_stock_gather):
        assert result["seen"] == result["unquantized"] > 0


def test_update_lp_params_also_gathers_through_qwz(ds_worlds):
    for result in ds_worlds.get(2).run(ranks.refresh_through_update_lp_params):
        assert result["extra_gathers"] == 1
        assert result["hash_unchanged"]  # same masters, same decode


# --------------------------------------------------------------------------- #
# Parity with qwz's own engine (qwz.initialize)
# --------------------------------------------------------------------------- #

PARITY = [(2, 2, "fp32"), (2, 2, "bf16"), (4, 1, "fp32"), (4, 1, "bf16")]
PARITY_IDS = [f"w{w}-stage{s}-{d}" for w, s, d in PARITY]


def _assert_parity(results: list[dict], world_size: int, dtype: str) -> None:
    for rank, result in enumerate(results):
        assert result["violations"] == 0, (rank, result["violations"], result["worst_ratio"])
        assert result["checked"] > 0
        assert result["losses"]["qwz"][0] == result["losses"]["deepspeed"][0], rank
        ours, theirs = result["grad_norms"]["qwz"][0], result["grad_norms"]["deepspeed"][0]
        tolerance = 1e-6 if dtype == "fp32" else (world_size - 1) * 2**-9
        assert abs(ours - theirs) <= tolerance * theirs, (rank, ours, theirs)
        assert all(torch.isfinite(torch.tensor(result["grad_norms"]["deepspeed"])))


@pytest.mark.parametrize(("world_size", "stage", "dtype"), PARITY, ids=PARITY_IDS)
def test_parity_qwz_engine_unquantized_vs_stock_deepspeed(ds_worlds, world_size, stage, dtype):
    results = ds_worlds.get(world_size).run(
        ranks.parity_with_qwz_engine, stage, dtype, STEPS, quantized=False
    )
    _assert_parity(results, world_size, dtype)
    for result in results:
        assert result["group_sizes"] == (None, None)


@pytest.mark.parametrize(("world_size", "stage", "dtype"), PARITY, ids=PARITY_IDS)
def test_parity_qwz_engine_vs_deepspeed_with_qwz_same_group_size(
    ds_worlds, world_size, stage, dtype
):
    results = ds_worlds.get(world_size).run(
        ranks.parity_with_qwz_engine, stage, dtype, STEPS, quantized=True, group_size=64
    )
    _assert_parity(results, world_size, dtype)
    for result in results:
        assert result["group_sizes"] == (64, 64)
