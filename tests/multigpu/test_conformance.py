"""The PR's config rules through real subjects' own parsers and engines
(qualify/run/conformance_run.py ``run_table``, one subprocess per table, as ``qwz-qualify run``
runs it), judged by ``conformance`` ([Note: the PR's config rules]).

DeepSpeed's own code comes from the branches of the worker's one checkout of the installed
DeepSpeed (``deepspeed_variants``, tests/multigpu/conftest.py: its comm op is built once per
worker): stock 0.19.8 (``main``), ``proposal.patch`` and each variant of
``CONFORMANCE_BROKEN`` on top of it. About ten seconds per table once the op is built.
"""

from __future__ import annotations

import pytest

from qwz.qualify.evidence.rules import conformance
from qwz.qualify.run.conformance_run import run_table
from tests.deepspeed_checkout import CONFORMANCE_BROKEN, use_variant
from tests.unit.records import make_record

pytestmark = pytest.mark.multigpu
pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

BROKEN_ROWS = {
    "broken_group_size_multiple_of_4": ["stage2-g12"],
    "broken_stage3_group_size": ["stage3-g128"],
    "broken_fp32_accepted": ["stage1-fp32", "stage2-fp32"],
}
"""The rows each broken variant must fail, and only those."""


def _judge(table: dict, subject: str) -> tuple:
    assert table["error"] is None, table["error"]
    assert [row["row"] for row in table["rows"]] == [row.name for row in conformance.ROWS]
    built = make_record(conformance=table, subject={"name": subject})
    check = next(check for check in built.checks if check.name == "conformance")
    return check, {row["row"]: row for row in table["rows"]}


def _native(checkout, variant: str) -> tuple:
    use_variant(checkout, variant)
    return _judge(run_table("deepspeed-native", deepspeed_src=str(checkout)), "deepspeed-native")


def test_the_proposal_passes_and_refuses_fp32_and_zenflow_at_initialization(deepspeed_variants):
    check, rows = _native(deepspeed_variants, "proposal")
    assert check.status == "pass", check.detail
    for name in ("stage1-fp32", "stage2-fp32", "stage1-zenflow", "stage2-zenflow"):
        assert rows[name]["refused_at"] == "initialize", rows[name]
        assert rows[name]["message"].startswith("ValueError: zero_optimization.zero_quantized")
    for name in ("stage1-g8192", "stage2-omitted", "stage2-zenflow-unquantized"):
        assert rows[name]["ran"] == ["parse", "initialize"] and rows[name]["observed"] == "accepted"
    assert rows["stage2-g8192"]["group_size"] == 8192 and rows["stage2-omitted"]["group_size"] == 64
    assert rows["stage3-g64"]["ran"] == ["parse"]


@pytest.mark.parametrize("variant", CONFORMANCE_BROKEN)
def test_a_broken_config_rule_fails_naming_its_rows(deepspeed_variants, variant):
    check, _ = _native(deepspeed_variants, variant)
    assert check.status == "fail" and check.numbers["failed"] == BROKEN_ROWS[variant]


def test_stock_0_19_shows_each_refusal_with_its_message_and_fails_what_it_ignores(
    deepspeed_variants,
):
    check, rows = _native(deepspeed_variants, "main")
    assert check.status == "fail"
    refused = [row for row in rows.values() if row["observed"] == "refused"]
    keyed = [
        row for row in rows.values() if conformance.GROUP_SIZE in row["config"]["zero_optimization"]
    ]
    assert refused == keyed  # every config with the key, and only those
    assert all("Extra inputs are not permitted" in row["message"] for row in refused)
    for name in ("stage1-fp32", "stage2-fp32", "stage1-zenflow", "stage2-zenflow", "stage3-g64"):
        assert name in check.numbers["failed"]


def test_qwz_s_engine_passes_with_its_stated_differences():
    check, rows = _judge(run_table("qwz"), "qwz")
    assert check.status == "pass", check.detail
    assert rows["stage2-fp32"]["observed"] == "accepted"  # qwz's stated difference
    assert rows["stage2-g12"]["message"].startswith("ConfigError: zero_optimization.")


def test_the_deepspeed_drop_in_passes_with_its_stated_difference():
    check, rows = _judge(run_table("deepspeed"), "deepspeed")
    assert check.status == "pass", check.detail
    assert rows["stage2-zenflow"]["message"].startswith("ConfigError: zero_optimization.")
    assert rows["stage2-zenflow-unquantized"]["observed"] == "accepted"  # stock DeepSpeed's path
