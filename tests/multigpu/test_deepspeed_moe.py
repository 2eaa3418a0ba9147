"""DeepSpeed's MoE through the drop-in: expert parameters gather over their own group.

``models.MoEMLP`` (a dense Linear, DeepSpeed's MoE layer with one expert per
rank, a dense head) on 4 ranks, bf16, through ``qwz.integrations.deepspeed``.
DeepSpeed's ZeRO-1/2 optimizer puts the experts in a param group of their own
(``moe: True``) partitioned over the expert-data-parallel group: with expert
parallelism 2 the ranks {0, 2} hold expert 0 and {1, 3} expert 1 (DeepSpeed's
expert-then-data layout), while the dense parameters are partitioned over all
4 ranks. qwz must gather each param group over its own group, with that group's
world size: per rank and step, one collective on each group (seen by the
``WireProbe``, keyed by the group's global ranks), each moving
``P_pad * (1 + 4/G)`` plus that group's exact stream, the row padded to 4 bytes
([Note: wire row]), as in ``test_deepspeed.py::test_weight_gather_wire_bytes``.
Replicas of a parameter are the ranks holding it: all 4 for dense parameters,
the two ranks of an expert-data-parallel group for an expert. With expert
parallelism 4 every expert-data-parallel group is one rank, which is copied
exactly from its master ([Note: one rank gathers exactly]).

Each rank's experts are initialised from their global index, so different
experts start different and a gather over the wrong pair of ranks shows.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip(
    "deepspeed", reason="the DeepSpeed integration tests need deepspeed (pip install .[deepspeed])"
)

from qwz.layout import quantized_unit_bytes
from tests.multigpu import moe_ranks

pytestmark = [pytest.mark.multigpu]

WORLD_SIZE = 4
ALL_RANKS = tuple(range(WORLD_SIZE))
STEPS = 4
GROUP_SIZE = 64
BF16_BYTES = 2
EXPERTS_PER_RANK = 1

# (ZeRO stage, expert-parallel size)
EXPERT_DP_OF_TWO = [(2, 2), (1, 2)]
EXPERT_DP_OF_ONE = (2, 4)
IDS = [f"stage{stage}-ep{ep_size}" for stage, ep_size in EXPERT_DP_OF_TWO]


def _train(worlds, stage: int, ep_size: int, rerun: int = 0) -> list[dict]:
    return worlds.run_once(
        WORLD_SIZE,
        moe_ranks.train,
        stage,
        ep_size,
        ep_size * EXPERTS_PER_RANK,
        STEPS,
        rerun=rerun,
    )


def _expert_data_parallel_ranks(rank: int, ep_size: int) -> tuple[int, ...]:
    """DeepSpeed's expert-then-data layout: ranks r, r + ep_size, ... hold the same experts."""
    return tuple(range(rank % ep_size, WORLD_SIZE, ep_size))


def _is_expert(name: str) -> bool:
    return ".deepspeed_experts." in name


def _dense_and_expert(result: dict) -> tuple[dict, dict]:
    dense, expert = result["param_groups"]  # DeepSpeed keeps the dense group first
    return dense, expert


def _expected_row_bytes(partition_numel: int, exact_numels: list[int]) -> int:
    """One rank's bytes in one gather of a param group, from first principles: whole groups of
    G (int8 codes + an fp32 scale each), then the longest rank's exact elements in bf16, the
    row padded to 4 bytes."""
    num_groups = math.ceil(partition_numel / GROUP_SIZE)
    row = num_groups * quantized_unit_bytes(GROUP_SIZE) + max(exact_numels) * BF16_BYTES
    return math.ceil(row / 4) * 4


@pytest.mark.parametrize(("stage", "ep_size"), EXPERT_DP_OF_TWO, ids=IDS)
def test_experts_gather_over_their_expert_data_parallel_group(worlds, stage, ep_size):
    results = _train(worlds, stage, ep_size)
    for rank, result in enumerate(results):
        expert_ranks = _expert_data_parallel_ranks(rank, ep_size)
        assert tuple(result["expert_data_parallel_ranks"]) == expert_ranks, rank
        dense, expert = _dense_and_expert(result)
        assert not dense["moe"] and expert["moe"], rank
        assert not any(map(_is_expert, dense["params"])), (rank, dense["params"])
        assert expert["params"] and all(map(_is_expert, expert["params"])), rank
        assert tuple(dense["partitioned_over"]) == ALL_RANKS, (rank, dense)
        assert tuple(dense["gathered_over"]) == ALL_RANKS, (rank, dense)
        assert tuple(expert["partitioned_over"]) == expert_ranks, (rank, expert)
        assert tuple(expert["gathered_over"]) == expert_ranks, (rank, expert)
        # On the wire: every step, one collective on each group and on no other.
        for step, calls in enumerate(result["gather_calls_by_group"], start=1):
            assert calls == {ALL_RANKS: 1, expert_ranks: 1}, (rank, step, calls)


@pytest.mark.parametrize(("stage", "ep_size"), EXPERT_DP_OF_TWO, ids=IDS)
def test_replicas_of_every_parameter_bit_identical_after_every_step(worlds, stage, ep_size):
    results = _train(worlds, stage, ep_size)
    names = sorted(results[0]["hashes"][0])
    assert any(map(_is_expert, names)) and not all(map(_is_expert, names))
    holders = {_expert_data_parallel_ranks(rank, ep_size) for rank in ALL_RANKS}
    for step in range(STEPS):
        for name in names:
            hashes = [result["hashes"][step][name] for result in results]
            if not _is_expert(name):
                assert len(set(hashes)) == 1, (step + 1, name, hashes)
                continue
            for ranks in holders:
                assert len({hashes[r] for r in ranks}) == 1, (step + 1, name, ranks, hashes)
            # Different experts, different weights: the check compares the right ranks.
            assert len(set(hashes)) == len(holders), (step + 1, name, hashes)
    first, last = results[0]["hashes"][0], results[0]["hashes"][-1]
    assert all(first[name] != last[name] for name in names), "a parameter never moved"


@pytest.mark.parametrize(("stage", "ep_size"), EXPERT_DP_OF_TWO, ids=IDS)
def test_weight_gather_wire_bytes_per_group(worlds, stage, ep_size):
    results = _train(worlds, stage, ep_size)
    for rank, result in enumerate(results):
        dense, expert = _dense_and_expert(result)
        expected = {
            ALL_RANKS: _expected_row_bytes(dense["partition_numel"], dense["exact_numels"]),
            _expert_data_parallel_ranks(rank, ep_size): _expected_row_bytes(
                expert["partition_numel"], expert["exact_numels"]
            ),
        }
        assert max(expert["exact_numels"]) > 0 and max(dense["exact_numels"]) > 0
        unquantized = (dense["partition_numel"] + expert["partition_numel"]) * BF16_BYTES
        assert result["unquantized_bytes"] == unquantized
        for step, sent in enumerate(result["gather_bytes_by_group"], start=1):
            assert sent == expected, (rank, step, sent, expected)
            assert sum(sent.values()) < unquantized


@pytest.mark.parametrize(("stage", "ep_size"), EXPERT_DP_OF_TWO, ids=IDS)
def test_losses_finite_and_every_step_gathers_through_qwz(worlds, stage, ep_size):
    for rank, result in enumerate(_train(worlds, stage, ep_size)):
        assert len(result["losses"]) == STEPS
        assert all(map(math.isfinite, result["losses"])), (rank, result["losses"])
        assert result["qwz_gathers"] == [1] * STEPS, (rank, result["qwz_gathers"])
        assert result["group_size"] == GROUP_SIZE, rank
        # Both groups quantized: neither working partition is its master's plain cast.
        cast = result["working_is_master_cast"]
        assert cast == [False, False], (rank, cast)


def test_identical_runs_give_identical_final_hashes(worlds):
    first = _train(worlds, 2, 2)
    second = _train(worlds, 2, 2, rerun=1)
    for rank, (one, other) in enumerate(zip(first, second, strict=True)):
        differ = sorted(
            name
            for name in one["hashes"][-1]
            if one["hashes"][-1][name] != other["hashes"][-1][name]
        )
        assert not differ, f"rank {rank}: final hashes differ between two runs: {differ}"


def test_one_rank_expert_groups_are_copied_exactly(worlds):
    """Expert parallelism 4: each expert lives on one rank, its expert-data-parallel group is
    that rank alone. Nothing travels for it and its working copy is its master cast to bf16,
    while the dense group is still quantized over all 4 ranks."""
    results = _train(worlds, *EXPERT_DP_OF_ONE)
    for rank, result in enumerate(results):
        dense, expert = _dense_and_expert(result)
        assert tuple(expert["partitioned_over"]) == (rank,), (rank, expert)
        assert tuple(expert["gathered_over"]) == (rank,), (rank, expert)
        cast = result["working_is_master_cast"]
        assert cast == [False, True], (rank, cast)
        expected = _expected_row_bytes(dense["partition_numel"], dense["exact_numels"])
        for step, sent in enumerate(result["gather_bytes_by_group"], start=1):
            assert sent == {ALL_RANKS: expected}, (rank, step, sent)
        assert result["unquantized_bytes"] == dense["partition_numel"] * BF16_BYTES
        assert result["group_size"] == GROUP_SIZE
        assert all(map(math.isfinite, result["losses"])), (rank, result["losses"])
    for step in range(STEPS):
        for name in results[0]["hashes"][step]:
            hashes = {result["hashes"][step][name] for result in results}
            assert len(hashes) == (WORLD_SIZE if _is_expert(name) else 1), (step + 1, name)
