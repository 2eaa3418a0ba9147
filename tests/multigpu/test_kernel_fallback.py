"""A fused-kernel self-test that fails on one rank (a GPU whose compile fails, forced here
on the CPU) makes every rank run the eager kernels, and the record and the report name the
fallback and the failing rank's reason on every rank, instead of an error that ends the
run ([Note: fused kernels checked before a run], qwz/qualify/request/kernel_check.py;
collectives.agree_on_kernels)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from qwz.kernels import choice
from qwz.qualify.base.plan import RunPlan
from qwz.qualify.evidence import build as evidence
from qwz.qualify.review import report
from qwz.qualify.run.runner import qualify_rank
from qwz.qualify.run.workloads import get_workload

pytestmark = pytest.mark.multigpu

FAILING_RANK = 1
FORCED = "torch.compile on cuda:1: forced failure"
PLAN = RunPlan(workload=get_workload("mlp"), steps=2, blocks=0, eval_every=1)


def qualify_with_a_failing_self_test(plan: RunPlan):
    """Rank body: the fused kernels' self-test fails on FAILING_RANK only."""
    original = choice.self_test
    if dist.get_rank() == FAILING_RANK:
        choice.self_test = lambda device=None, dtype=None: FORCED
    try:
        return qualify_rank(plan)
    finally:
        choice.self_test = original


def test_one_rank_s_failing_self_test_means_eager_everywhere_recorded(worlds):
    assert PLAN.kernels == "fused"
    record = evidence.build_record(
        PLAN, worlds.get(2).run(qualify_with_a_failing_self_test, PLAN)[0]
    )
    assert not [check for check in record.checks if check.status == "fail"]
    for own in record.own_shards:
        assert [use.kernels for use in own.kernels] == ["eager", "eager"], own.arm
        for use in own.kernels:
            [fallback] = use.fallbacks
            assert f"rank {FAILING_RANK}: {FORCED}" in fallback, (own.arm, use.rank)
            assert "fused kernels serve on 1 of 2 ranks only" in fallback
    text = report.render_markdown(record)
    assert f"**Kernel fallbacks of `{record.own_shards[-1].arm}`:** rank 0: " in text
