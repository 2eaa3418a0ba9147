"""[Note: replica sets] (qwz/qualify/run/replicas.py) and the checks that use them: with
expert parallelism a parameter name holds different experts on different ranks, so ranks are
compared per set of ranks holding the same thing -- never all ranks -- and the record's
final hashes, wire groups and verdict say so. Pure functions and one-process paths only;
the multi-rank runs are in tests/multigpu/test_qualify_moe.py."""

from __future__ import annotations

import hashlib

import torch

from qwz.hashing import param_hash
from qwz.qualify.evidence.rules import identical_replicas
from qwz.qualify.run import replicas
from qwz.qualify.run.observers import digest
from qwz.shards import ShardSlot, make_own_shard
from tests.unit.records import CANDIDATE, make_payload, make_record

NAMES = ("up.weight", "experts.0.weight", "head.bias")
EXPERT_PARALLEL_4 = replicas.ReplicaSets(
    NAMES,
    tuple(
        ("dense", f"expert{rank % 2}", "dense")  # ep_size 2 on 4 ranks: {0, 2} and {1, 3}
        for rank in range(4)
    ),
)


def test_a_parameter_is_compared_over_the_ranks_holding_the_same_expert():
    sets = EXPERT_PARALLEL_4
    assert sets.holders(0, "dense") == (0, 1, 2, 3)
    assert sets.holders(1, "expert0") == (0, 2)
    assert sets.holders(1, "expert1") == (1, 3)
    assert sets.entries() == [
        (0, "dense", (0, 1, 2, 3)),
        (1, "expert0", (0, 2)),
        (1, "expert1", (1, 3)),
        (2, "dense", (0, 1, 2, 3)),
    ]
    assert [sets.label(index, key) for index, key, _ in sets.entries()] == [
        "up.weight",
        "experts.0.weight@expert0",
        "experts.0.weight@expert1",
        "head.bias",
    ]
    assert sets.key_sets() == {"dense": (0, 1, 2, 3), "expert0": (0, 2), "expert1": (1, 3)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_without_experts_the_sets_are_every_rank_and_the_hashes_are_the_model_s():
    model = _model()
    keys = {name: replicas.DENSE for name, _ in model.named_parameters()}
    sets = replicas.ReplicaSets.agree(keys)  # one process: no collective
    assert sets.names == tuple(keys) and sets.keys == (tuple(keys.values()),)
    assert replicas.divergence(model, sets) == []
    assert replicas.final_hashes(model, keys) == (param_hash(model), {"dense": param_hash(model)})


def test_final_hashes_split_by_key_change_with_their_own_parameters_only():
    model = _model()
    keys = {"0.weight": "dense", "0.bias": "dense", "1.weight": "expert3", "1.bias": "expert3"}
    whole_before, before = replicas.final_hashes(model, keys)
    with torch.no_grad():
        model[1].bias[0] += 1
    whole_after, after = replicas.final_hashes(model, keys)
    assert set(before) == {"dense", "expert3"}
    assert after["dense"] == before["dense"] and after["expert3"] != before["expert3"]
    assert whole_before == param_hash(_model()) != whole_after == param_hash(model)


def test_step_one_digests_are_per_parameter_and_key_and_match_the_all_rank_digest():
    master = torch.arange(12, dtype=torch.float32) / 7
    slots = [ShardSlot("a", 0, 8, 0), ShardSlot("b", 8, 12, 0)]
    shard = make_own_shard("group0", master, master.to(torch.bfloat16), None, None, slots)
    dense = replicas.ReplicaSets(("a", "b"), (("dense", "dense"),))
    assert replicas.master_digests([shard], dense) == digest.master_digests([shard], ["a", "b"])
    expert = replicas.ReplicaSets(("a", "b"), (("dense", "expert1"),))
    digests = replicas.master_digests([shard], expert)
    assert set(digests) == {"a", "b@expert1"}
    assert digests["b@expert1"] == digest.master_digests([shard], ["a", "b"])["b"]


def test_what_a_wire_group_carries():
    keys = {"up.weight": "dense", "e.weight": "expert0", "e.bias": "expert0"}
    assert replicas.wire_kind(["up.weight"], keys) == "dense"
    assert replicas.wire_kind(["e.weight", "e.bias"], keys) == "expert"
    assert replicas.wire_kind(["up.weight", "e.bias"], keys) == "mixed"
    assert replicas.wire_kind([], keys) == "dense"  # a shard of padding only


def test_the_arm_hash_is_the_ranks_hash_or_a_digest_of_every_set_s():
    assert identical_replicas.arm_final_hash(["h", "h"], [["h", "h"]]) == "h"
    assert identical_replicas.arm_final_hash(["h", "g"], [["h", "g"]]) is None
    assert identical_replicas.arm_final_hash(["h", None], []) is None
    sets = [["d", "d", "d", "d"], ["e0", "e0"], ["e1", "e1"]]
    expected = hashlib.sha256(b"d\ne0\ne1").hexdigest()
    assert identical_replicas.arm_final_hash(["x", "y", "x", "y"], sets) == expected
    assert (
        identical_replicas.arm_final_hash(["x", "y", "x", "y"], [*sets[:2], ["e1", "e2"]]) is None
    )


def _replicas_check(replica_sets: list[dict]):
    payload = make_payload()
    hashes = next(item for item in payload["hashes"] if item["arm"] == CANDIDATE)
    hashes["per_rank"] = ["a" * 64, "b" * 64]  # different experts: the ranks' hashes differ
    hashes["replica_sets"] = replica_sets
    return {check.name: check for check in make_record(**payload).checks}[f"replicas[{CANDIDATE}]"]


def test_replicas_pass_when_every_set_agrees_although_the_ranks_hashes_differ():
    check = _replicas_check(
        [
            {"params": "dense", "ranks": [0, 1], "hashes": ["d" * 64, "d" * 64]},
            {"params": "expert0", "ranks": [0], "hashes": ["e" * 64]},
            {"params": "expert1", "ranks": [1], "hashes": ["f" * 64]},
        ]
    )
    assert check.status == "pass", check.detail
    assert "expert0: ranks [0]" in check.detail and "dense: ranks [0, 1]" in check.detail


def test_replicas_fail_naming_the_set_whose_ranks_disagree():
    check = _replicas_check(
        [
            {"params": "dense", "ranks": [0, 1], "hashes": ["d" * 64, "c" * 64]},
            {"params": "expert0", "ranks": [0], "hashes": ["e" * 64]},
        ]
    )
    assert check.status == "fail" and "dense over ranks [0, 1]" in check.detail


def test_a_record_without_replica_sets_compares_every_rank():
    assert _replicas_check([]).status == "fail"  # the per-rank hashes differ


def test_the_report_shows_each_set_s_hashes_and_whether_they_agree():
    from qwz.qualify.review import report

    payload = make_payload()
    hashes = next(item for item in payload["hashes"] if item["arm"] == CANDIDATE)
    hashes["per_rank"] = ["a" * 64, "b" * 64]
    hashes["replica_sets"] = [
        {"params": "dense", "ranks": [0, 1], "hashes": ["d" * 64, "d" * 64]},
        {"params": "expert0", "ranks": [0], "hashes": ["e" * 64]},
    ]
    row = next(
        line
        for line in report.render_markdown(make_record(**payload)).splitlines()
        if line.startswith(f"| `{CANDIDATE}` |") and "expert0 (ranks 0)" in line
    )
    assert "dense (ranks 0, 1)" in row and "| yes |" in row
