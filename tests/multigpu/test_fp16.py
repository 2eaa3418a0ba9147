"""fp16 training in qwz's engine on real process groups (gloo on CPU, 2 ranks).

DeepSpeed's CPU accelerator refuses fp16 on CPUs without AVX512-FP16, so this is where
fp16 ZeRO-1/2 training with dynamic loss scaling ([Note: dynamic loss scale]) is covered
on every machine: against a plain torch reference with DeepSpeed's own loss scaler, with
one rank alone overflowing at SPIKE_STEP."""

from __future__ import annotations

import itertools

import pytest

from tests.multigpu import fp16_ranks

pytestmark = pytest.mark.multigpu

STEPS, SPIKE_STEP = 16, 14


def check_skips(results: list[dict]) -> list[bool]:
    """Every rank skipped the same steps, a skipped step gathered nothing and changed no
    weight or master, a taken step did both; returns which steps overflowed."""
    overflows = [not step["stepped"] for step in results[0]["steps"]]
    for rank, result in enumerate(results):
        assert result["dtype"] == "torch.float16"
        assert [not step["stepped"] for step in result["steps"]] == overflows, rank
        for index, step in enumerate(result["steps"], start=1):
            where = f"rank {rank}, step {index}"
            assert step["skipped_steps"] == sum(overflows[:index]), where
            if step["stepped"]:
                assert step["finite_norm"] and step["gather_bytes"] > 0, where
                assert not step["hash_unchanged"] and not step["masters_unchanged"], where
            else:
                assert not step["finite_norm"] and step["gather_bytes"] == 0, where
                assert step["hash_unchanged"] and step["masters_unchanged"], where
    for index in range(len(overflows)):
        assert len({result["steps"][index]["hash"] for result in results}) == 1, index
        assert len({result["steps"][index]["scale"] for result in results}) == 1, index
    # What the run claims to exercise: overflows from the scale, the one-rank spike, and a
    # scale that both grows and shrinks.
    assert any(overflows[: SPIKE_STEP - 1]) and overflows[SPIKE_STEP - 1], overflows
    scales = [step["scale"] for step in results[0]["steps"]]
    pairs = list(itertools.pairwise(scales))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs), scales
    return overflows


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_unquantized_equals_plain_torch_with_deepspeeds_scaler(worlds, stage):
    """Without quantization every step's weights equal the reference's bit for bit, and
    the scale and the skipped steps are DeepSpeed's loss scaler's."""
    results = worlds.get(2).run(fp16_ranks.fp16_with_overflows, stage, False, STEPS, SPIKE_STEP)
    overflows = check_skips(results)
    for rank, result in enumerate(results):
        for index, step in enumerate(result["steps"], start=1):
            where = f"rank {rank}, step {index}"
            assert step["scale"] == step["reference_scale"], where
            assert (not step["stepped"]) == step["reference_overflow"], where
            assert step["hash"] == step["reference_hash"], where
    print(f"stage {stage}: overflowed steps {[i + 1 for i, o in enumerate(overflows) if o]}")


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_quantized_skips_overflows_on_every_rank_together(worlds, stage):
    """With the quantized gather: the same skip discipline, replicas identical after every
    step, and the gather really quantized."""
    results = worlds.get(2).run(fp16_ranks.fp16_with_overflows, stage, True, STEPS, SPIKE_STEP)
    check_skips(results)
    assert all(result["group_size"] == 64 for result in results)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_resume_restores_the_loss_scale_bit_for_bit(worlds, tmp_path, stage):
    """Saved after step 10 (its overflow spent a unit of hysteresis; the next one
    halves the scale), resumed in a fresh engine: every later step's hash, scale and skip
    equal the uninterrupted run's."""
    save_at = 10
    results = worlds.get(2).run(
        fp16_ranks.resume_fp16, str(tmp_path), stage, save_at, STEPS, SPIKE_STEP
    )
    for rank, result in enumerate(results):
        assert result["resumed"] == result["expected"], rank
        skips = [not stepped for _, _, stepped in result["expected"]]
        assert result["skipped_steps"] == sum(skips)
        assert any(skips[:save_at]) and any(skips[save_at:]), skips  # the state mattered
    assert results[0]["expected"] == results[1]["expected"]
