"""qwz's engine at its edges, on real process groups: frozen parameters and buffers at
initialisation, checkpoints and resume."""

from __future__ import annotations

import pytest

from tests.multigpu import edge_ranks

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
