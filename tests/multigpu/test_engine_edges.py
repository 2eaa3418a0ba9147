"""qwz's engine at its edges, on real process groups: frozen parameters and buffers at
initialisation, checkpoints and resume."""

from __future__ import annotations

import pytest

import qwz
from tests.multigpu import edge_ranks, models, ranks

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("stage", [1, 2])
def test_initialize_broadcasts_frozen_parameters_and_buffers_from_rank0(worlds, stage):
    results = worlds.get(2).run(edge_ranks.frozen_and_buffers_after_initialize, stage)
    # The ranks really did start different, in the frozen base and in the buffers alike.
    assert results[0]["params_before"] != results[1]["params_before"]
    assert results[0]["buffers_before"] != results[1]["buffers_before"]
    for key in ("params", "buffers", "frozen"):
        assert results[0][key] == results[1][key], key
    # Rank 0's state won: its hashes did not move (the model was already in fp32).
    assert results[0]["params"] == results[0]["params_before"]
    assert results[0]["buffers"] == results[0]["buffers_before"]


RESUME_SAVE_AT, RESUME_TOTAL = 3, 6


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_gives_the_hashes_of_the_uninterrupted_run(worlds, tmp_path, stage):
    """2 ranks, bf16, quantized gather: save after step 3, load into a fresh engine built
    from another seed, train to step 6; every hash equals the uninterrupted run's."""
    results = worlds.get(2).run(
        edge_ranks.resume_matches_uninterrupted,
        str(tmp_path),
        stage,
        RESUME_SAVE_AT,
        RESUME_TOTAL,
    )
    for rank, result in enumerate(results):
        assert result["quantization_group_size"] == 64, rank  # the gather really quantizes
        assert result["counters"] == (RESUME_SAVE_AT, RESUME_SAVE_AT), rank
        assert result["at_load"] == result["expected"][RESUME_SAVE_AT - 1], rank
        assert result["resumed"] == result["expected"], rank
    assert results[0]["expected"] == results[1]["expected"]
    assert len(set(results[0]["expected"])) == RESUME_TOTAL  # every step moved the weights
    print(
        f"stage {stage}: final hash uninterrupted {results[0]['expected'][-1]}, "
        f"resumed {results[0]['resumed'][-1]}"
    )


def test_two_rank_checkpoint_refused_at_one_rank_and_damage_refused_on_every_rank(worlds, tmp_path):
    saved_hashes = worlds.get(2).run(edge_ranks.save_small_checkpoint, str(tmp_path), 2)
    assert saved_hashes[0] == saved_hashes[1]
    # This test process has no process group: an engine of world size 1.
    single = qwz.initialize(
        models.build_odd_width_mlp(0), config=ranks.ds_config(stage=2, quantized=True, dtype="fp32")
    )
    with pytest.raises(qwz.CheckpointError) as refused:
        single.load_checkpoint(tmp_path)
    assert "world_size is 2 in the checkpoint but 1 in this engine" in str(refused.value)
    # Rank 1's file damaged: rank 0's own file is intact, yet neither rank loads anything.
    edge_ranks.rank_file(str(tmp_path), 1).write_bytes(b"not a checkpoint")
    results = worlds.get(2).run(edge_ranks.load_is_all_or_nothing, str(tmp_path), 2)
    messages = {result["message"] for result in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "rank 1: " in message and "rank00001.pt is damaged" in message
    assert "rank 0: " not in message
    for result in results:
        assert result["unchanged"] and result["steps"] == 0
