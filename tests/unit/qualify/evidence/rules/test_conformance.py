"""The ``conformance`` check ([Note: the PR's config rules], qualify/evidence/rules/conformance.py):
the judge's verdicts on tables real subjects recorded (tests/fixtures/conformance/, regenerated
by its generate.py), on each kind of row broken on purpose, on a harness failure and on old
records; and qwz's own parser and engine with a rule broken in this process
(qualify/run/conformance_run.py ``observe``, what the table's subprocess runs)."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

import qwz.config
from qwz.qualify.evidence import record, rejudge, schema
from qwz.qualify.evidence.rules import conformance
from qwz.qualify.review import report
from qwz.qualify.run import conformance_run
from tests.unit.records import conformance_table, make_record

FIXTURES = pathlib.Path(__file__).resolve().parents[4] / "fixtures"


def judge(table: dict, subject: str = "deepspeed-native") -> schema.Check:
    built = make_record(conformance=table, subject={"name": subject})
    [check] = [check for check in built.checks if check.name == "conformance"]
    return check


def verdicts(check: schema.Check) -> dict[str, str]:
    return {row["row"]: row["verdict"] for row in check.numbers["rows"]}


def with_rows(table: dict, **observed: str) -> dict:
    """`table` with the named rows' outcomes replaced (``stage2_g12="accepted"``)."""
    table = copy.deepcopy(table)
    for row in table["rows"]:
        outcome = observed.get(row["row"].replace("-", "_").replace(".", "_"))
        if outcome is not None:
            refused = outcome == "refused"
            row |= {"observed": outcome, "refused_at": "parse" if refused else None}
            row |= {"message": "ValueError: made up" if refused else None}
    return table


# ------------------------------------------------------------------ real subjects' tables
def test_the_proposal_passes_every_judged_row_and_shows_the_open_one_as_context():
    check = judge(conformance_table("deepspeed-native-proposal"))
    assert check.status == "pass", check.detail
    assert check.numbers["judged"] == len(conformance.ROWS) - 1 and check.numbers["failed"] == []
    assert verdicts(check)["stage2-g64-string"] == conformance.OPEN_ROW
    observed = {row["row"]: row for row in conformance_table("deepspeed-native-proposal")["rows"]}
    assert observed["stage2-g64-string"]["observed"] == "accepted"  # lax pydantic: "64" is 64
    for name in ("stage1-fp32", "stage2-fp32", "stage1-zenflow", "stage2-zenflow"):
        assert observed[name]["refused_at"] == "initialize", observed[name]


def test_stock_0_19_fails_the_rows_it_does_not_refuse_and_shows_each_refusal_with_its_message():
    table = conformance_table("deepspeed-native-stock")
    check = judge(table)
    assert check.status == "fail"
    expected_failures = {
        *(f"stage{stage}-g{size}" for stage in (1, 2) for size in (8, 64, 8192)),
        "stage3-g64",  # the key refused: an unknown field
        "stage1-fp32", "stage2-fp32", "stage1-zenflow", "stage2-zenflow",  # the flag ignored
    }  # fmt: skip
    assert set(check.numbers["failed"]) == expected_failures
    assert all(name in check.detail for name in expected_failures)
    for row in table["rows"]:
        if conformance.GROUP_SIZE in row["config"]["zero_optimization"]:
            assert row["observed"] == "refused" and row["refused_at"] == "parse"
            assert (
                "zero_quantized_weights_group_size Extra inputs are not permitted"
                in (row["message"])
            )
    assert verdicts(check)["stage2-g12"] == conformance.PASS  # refused, for its own reason


@pytest.mark.parametrize(
    "variant, rows",
    [
        ("broken_group_size_multiple_of_4", ["stage2-g12"]),
        ("broken_stage3_group_size", ["stage3-g128"]),
        ("broken_fp32_accepted", ["stage1-fp32", "stage2-fp32"]),
    ],
)
def test_a_deepspeed_with_a_config_rule_broken_fails_naming_the_rows(variant, rows):
    check = judge(conformance_table(f"deepspeed-native-{variant}"))
    assert check.status == "fail" and check.numbers["failed"] == rows
    assert all(f"{row} (expected refuse, accepted)" in check.detail for row in rows)


def test_qwz_and_the_drop_in_pass_with_their_stated_differences_and_fail_as_the_pr():
    for subject in ("qwz", "deepspeed"):
        assert judge(conformance_table(subject), subject).status == "pass", subject
    # Judged as the PR, qwz's engine fails exactly where it states a difference.
    as_the_pr = judge(conformance_table("qwz"), "deepspeed-native")
    assert set(as_the_pr.numbers["failed"]) == set(conformance.DIFFERENCES["qwz"])
    as_the_pr = judge(conformance_table("deepspeed"), "deepspeed-native")
    assert set(as_the_pr.numbers["failed"]) == set(conformance.DIFFERENCES["deepspeed"])


# ------------------------------------------------------------------ each kind of row
def test_an_accept_row_refused_and_a_refuse_row_accepted_fail():
    proposal = conformance_table("deepspeed-native-proposal")
    check = judge(with_rows(proposal, stage1_g8192="refused", stage2_g0="accepted"))
    assert check.status == "fail" and check.numbers["failed"] == ["stage1-g8192", "stage2-g0"]
    assert "stage1-g8192 (expected accept, refused)" in check.detail


def test_an_open_row_is_context_whatever_the_subject_does():
    proposal = conformance_table("deepspeed-native-proposal")
    for outcome in ("accepted", "refused"):
        check = judge(with_rows(proposal, stage2_g64_string=outcome))
        assert check.status == "pass" and verdicts(check)["stage2-g64-string"] == "open"


def test_a_refusal_whose_control_was_refused_too_is_unattributable_and_the_control_fails():
    """ZenFlow refused with and without quantized weights: the refusal shows nothing about the
    rule; the control (the default path unchanged) is what fails."""
    proposal = conformance_table("deepspeed-native-proposal")
    check = judge(with_rows(proposal, stage2_zenflow_unquantized="refused"))
    assert check.status == "fail" and check.numbers["failed"] == ["stage2-zenflow-unquantized"]
    assert verdicts(check)["stage2-zenflow"] == conformance.UNATTRIBUTABLE
    # Where the subject states that it refuses the control (qwz), the row is judged.
    assert verdicts(judge(conformance_table("qwz"), "qwz"))["stage2-zenflow"] == conformance.PASS


def test_a_missing_row_or_another_config_under_its_name_is_inconclusive():
    proposal = conformance_table("deepspeed-native-proposal")
    missing = dict(proposal, rows=[row for row in proposal["rows"] if row["row"] != "stage2-g12"])
    check = judge(missing)
    assert check.status == "inconclusive" and "stage2-g12" in check.detail
    other = copy.deepcopy(proposal)
    row = next(row for row in other["rows"] if row["row"] == "stage2-g12")
    row["config"]["zero_optimization"][conformance.GROUP_SIZE] = 16
    check = judge(other)
    assert check.status == "inconclusive" and verdicts(check)["stage2-g12"] == "other config"


def test_a_row_today_s_judge_does_not_know_is_context():
    proposal = conformance_table("deepspeed-native-proposal")
    extra = dict(proposal["rows"][0], row="stage2-g24-from-a-newer-judge")
    check = judge(dict(proposal, rows=[*proposal["rows"], extra]))
    assert check.status == "pass" and verdicts(check)[extra["row"]] == conformance.UNKNOWN_ROW


# ------------------------------------------------------------------ harness failures
def test_a_table_the_harness_could_not_run_is_inconclusive_never_a_fail():
    table = dict(conformance_table("deepspeed-native-proposal"), rows=[])
    table["error"] = "the table's process exited 1 without its rows: ModuleNotFoundError"
    built = make_record(conformance=table, subject={"name": "deepspeed-native"})
    check = next(check for check in built.checks if check.name == "conformance")
    assert check.status == "inconclusive" and "ModuleNotFoundError" in check.detail
    assert built.verdict.status == "INCONCLUSIVE" and built.verdict.failed == []


def test_a_table_process_that_dies_is_the_table_s_error(monkeypatch):
    monkeypatch.setattr(conformance_run, "CHILD", "import sys; sys.exit('no table here')")
    table = conformance_run.run_table("qwz")
    assert table["rows"] == [] and "without its rows (exited 1: no table here)" in table["error"]
    garbled = (
        "print(" + repr(conformance_run.MARKER + '{"rows": [{"row": 1}], "error": null}') + ")"
    )
    monkeypatch.setattr(conformance_run, "CHILD", garbled)
    table = conformance_run.run_table("qwz")
    assert table["rows"] == [] and "rows do not match the record's schema" in table["error"]
    assert make_record(conformance=table).verdict.status == "INCONCLUSIVE"


@pytest.mark.slow  # imports DeepSpeed in a fresh process
def test_a_deepspeed_source_without_deepspeed_is_the_table_s_error(tmp_path):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    table = conformance_run.run_table("deepspeed-native", deepspeed_src=str(tmp_path))
    assert table["rows"] == [] and "DeepSpeedSourceError" in table["error"], table["error"]


# ------------------------------------------------------------------ records
def test_a_schema_4_record_loads_and_reads_not_observed():
    loaded = record.load(FIXTURES / "records" / "schema4" / "record.json")
    assert loaded.upgraded_from == 4 and loaded.conformance is None
    today = rejudge.rejudged(loaded)
    [new] = [item for item in today.judgements if item.name == "conformance"]
    assert new.kind == "new" and new.today is not None and new.today.status == "n/a"
    assert new.today.detail.startswith("not observed: the record's schema lacks conformance")
    assert today.verdict.status == loaded.verdict.status == "PASS"
    assert "Not observed" in report.render_markdown(loaded)


def test_a_record_with_a_table_round_trips_and_the_same_rule_rejudges_it_the_same(tmp_path):
    built = make_record(conformance=conformance_table("deepspeed-native-stock"))
    record.save(built, tmp_path / "record.json")
    loaded = record.load(tmp_path / "record.json")
    assert loaded.conformance == built.conformance and loaded.verdict.status == "FAIL"
    assert all(item.kind == "same" for item in rejudge.rejudged(loaded).judgements)
    fresh = make_record(conformance=None)
    record.save(fresh, tmp_path / "none.json")
    assert record.load(tmp_path / "none.json").verdict.status == "PASS"


def test_the_report_shows_every_row_with_the_subject_s_message_and_the_stated_reasons():
    stock = report.render_markdown(
        make_record(
            conformance=conformance_table("deepspeed-native-stock"),
            subject={"name": "deepspeed-native"},
        )
    )
    assert "## The PR's config rules (conformance)" in stock
    assert all(f"| `{row.name}` |" in stock for row in conformance.ROWS)
    assert "| `stage2-g12` | stage 2, quantized, G=12, bf16 |" in stock
    assert "Extra inputs are not permitted" in stock and "| **FAIL** |" in stock
    assert "`stage2-g64-string` is open: the PR does not say" in stock
    qwz_report = report.render_markdown(make_record())
    assert "`stage1-fp32`: qwz expects accept, where the PR says refuse: qwz supports fp32" in (
        qwz_report
    )


# ------------------------------------------------------------------ qwz's parser, broken here
def _qwz_table() -> dict:
    rows = [
        conformance_run.observe("qwz", row.name, row.config, qwz_gather=True)
        for row in conformance.ROWS
    ]
    return {"parser": "p", "engine": "e", "rows": rows, "seconds": 0.0, "error": None}


def test_qwz_s_own_parser_and_engine_pass_in_this_process():
    table = _qwz_table()
    assert table["rows"] == json.loads(json.dumps(table["rows"]))  # JSON, as recorded
    assert judge(table, "qwz").status == "pass"


def test_qwz_accepting_a_group_size_of_12_fails_naming_the_row(monkeypatch):
    monkeypatch.setattr(qwz.config, "GROUP_SIZE_MULTIPLE", 4)
    check = judge(_qwz_table(), "qwz")
    assert check.status == "fail" and check.numbers["failed"] == ["stage2-g12"]


def test_qwz_accepting_a_non_default_size_with_zero_3_fails_naming_the_row(monkeypatch):
    validate = qwz.config.validate_group_size

    def without_the_stage_3_rule(value, *, stage, key=qwz.config.GROUP_SIZE_KEY):
        return validate(value, stage=min(stage, 2), key=key)

    monkeypatch.setattr(qwz.config, "validate_group_size", without_the_stage_3_rule)
    check = judge(_qwz_table(), "qwz")
    assert check.status == "fail" and check.numbers["failed"] == ["stage3-g128"]
