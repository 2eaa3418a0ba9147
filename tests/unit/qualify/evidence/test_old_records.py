"""Records written by older harnesses (tests/fixtures/records/, generate.sh): they load, compare,
show in ``history`` and resume in ``matrix`` at this head; and the cases of a changing judge
([Note: rule versions], [Note: rejudging], [Note: judge identity], [Note: schema versions])."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import checks, judge, record, rejudge, rules, schema, seal, upgrade
from qwz.qualify.evidence.rules import learning
from qwz.qualify.evidence.signing import configured_key, verifies
from qwz.qualify.matrix import cells
from qwz.qualify.matrix.matrix_spec import load as load_spec
from qwz.qualify.review import history
from qwz.qualify.review import judge_only as judge_only_module
from qwz.qualify.review import matrix as table
from qwz.qualify.review.compare import Status, compare, compare_files
from qwz.qualify.review.matrix_compare import compare_matrices

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "records"
FIXTURE_KEY = "qwz-fixture-signing-key-not-a-secret"
"""generate.sh's test key (not a secret): the fixtures' signatures verify with it."""
COMMITS = ("a4d3357", "f97cc3c", "6367dc4", "e0eb687")
OLD = sorted(path for sha in COMMITS for path in (FIXTURES / sha).rglob("record.json"))
MATRICES = sorted(
    FIXTURES / sha / "matrix" for sha in COMMITS if (FIXTURES / sha / "matrix").is_dir()
)
CURRENT = FIXTURES / "current" / "record.json"
SCHEMA_3 = FIXTURES / "schema3" / "record.json"
SCHEMA_4 = FIXTURES / "schema4" / "record.json"
"""The current fixture as the judge of schema 4 sealed it (update rule 1), before the plan
could keep a ``--ds-config`` file."""
"""The current fixture as today's judge sealed it in schema 3, before the fused kernels were
called "fused": its arms ran eager kernels, so its bytes hold no "compiled"."""
SCHEMA_4 = FIXTURES / "schema4" / "record.json"
"""The current fixture as today's judge sealed it in schema 4, before the short master
digests after every step (``step_masters``)."""
SCHEMA_5 = FIXTURES / "schema5" / "record.json"
"""The current fixture as the judge of schema 5 sealed it (own-shard rule 2), before the
contract named its schemes."""


def ids(paths):
    return [str(path.relative_to(FIXTURES)) for path in paths]


@pytest.fixture(autouse=True)
def fixture_key(monkeypatch):
    monkeypatch.delenv("QWZ_RECORD_KEY_FILE", raising=False)
    monkeypatch.setenv("QWZ_RECORD_KEY", FIXTURE_KEY)


def resealed(path: pathlib.Path) -> schema.Record:
    """A fresh record of the same observations: ``path``'s payload sealed by today's judge."""
    payload, _ = upgrade.upgrade(json.loads(path.read_text()))
    payload.pop("signature", None)
    return seal.seal(payload)


def rewritten(path: pathlib.Path, target: pathlib.Path, edit, *, redigest: bool) -> pathlib.Path:
    payload = json.loads(path.read_text())
    edit(payload)
    if redigest:
        payload["digest"] = seal.canonical_digest(
            {key: value for key, value in payload.items() if key != "signature"}
        )
    target.write_text(json.dumps(payload))
    return target


def test_the_fixtures_cover_three_older_commits_signed_records_and_matrices():
    assert {path.relative_to(FIXTURES).parts[0] for path in OLD} == set(COMMITS)
    signed = [path for path in OLD if "signature" in json.loads(path.read_text())]
    assert len(signed) >= 3 and len(MATRICES) >= 3
    assert all(json.loads(path.read_text())["schema_version"] == 2 for path in OLD)


# --------------------------------------------------------------------------- every fixture


@pytest.mark.parametrize("path", OLD, ids=ids(OLD))
def test_an_old_record_loads_and_is_rejudged_by_today_s_rules(path):
    loaded = record.load(path)
    assert loaded.upgraded_from == 2 and loaded.judge is None
    assert all(check.rule == 0 for check in loaded.checks)
    if loaded.signature is not None:
        assert verifies(loaded.digest, loaded.signature, configured_key())
    judged = rejudge.rejudged(loaded)
    assert judged.verdict.status == loaded.verdict.status == "PASS"
    assert all(check.rule == rules.RULES[rules.family_of(check.name)] for check in judged.checks)
    kinds = {item.name: item.kind for item in judged.judgements}
    new = sorted(name for name, kind in kinds.items() if kind == "new")
    assert set(kinds.values()) == {"changed", "new"}  # rule 0 -> today's; new families
    assert new == sorted([*(f"bounded[{probe.arm}]" for probe in loaded.probes), "conformance"])
    for name in new:  # its input is absent from schema 2: "not observed", never a verdict
        today = next(check for check in judged.checks if check.name == name)
        assert today.status == "n/a" and today.detail.startswith("not observed"), today


@pytest.mark.parametrize("path", OLD, ids=ids(OLD))
def test_an_old_record_compares_with_a_fresh_record_of_its_observations(path):
    """Re-sealed by today's judge: no regression, every judge change listed by check."""
    comparison = compare(record.load(path), resealed(path))
    assert comparison.status == Status.NO_REGRESSION, comparison.text()
    judged = [line for line in comparison.lines if line.startswith("judge changed: baseline")]
    assert judged, comparison.text()
    named = " ".join(judged)
    assert all(check.name in named for check in record.load(path).checks)
    assert "the baseline was written in schema 2 (read upgraded)" in comparison.lines


def test_a4d3357_s_finite_checks_are_reported_as_a_judge_change():
    """finite gained ``overflow_skipped`` (fp16) after a4d3357: the same observations, another
    rule's numbers -- a judge change, never a reason to refuse the record."""
    path = FIXTURES / "a4d3357" / "run" / "record.json"
    comparison = compare(record.load(path), resealed(path))
    assert (
        "judge changed: baseline: finite[candidate-g64]: PASS (rule 0: unversioned, schema 2) / "
        "PASS under rule 1 (overflow_skipped '(absent)' -> 0)"
    ) in comparison.lines


def test_the_e0eb687_record_compares_with_the_current_one_and_exits_0(tmp_path, capsys):
    baseline = FIXTURES / "e0eb687" / "run" / "record.json"
    code = cli.main(["compare", str(baseline), str(CURRENT)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "judge changed: baseline:" in out


def test_every_old_record_shows_in_history(tmp_path, capsys):
    nights = tmp_path / "history"
    for index, path in enumerate(OLD):
        (nights / f"night-{index}").mkdir(parents=True)
        shutil.copyfile(path, nights / f"night-{index}" / "record.json")
    found, problems = history.collect(nights)
    assert problems == [] and len(found) == len(OLD)
    assert cli.main(["history", str(nights), "--out", str(tmp_path / "trend")]) == 0
    text = (tmp_path / "trend" / "history.md").read_text()
    assert text.count("| PASS |") >= len(OLD)


@pytest.mark.parametrize("directory", MATRICES, ids=ids(MATRICES))
def test_an_old_matrix_resumes_without_running_a_cell(tmp_path, directory):
    out = tmp_path / "matrix"
    shutil.copytree(directory, out)
    launched = []

    def launch(argv, logs, stop):
        launched.append(argv)
        return 2

    spec = load_spec(directory / "fixture.toml")
    matrix = cells.MatrixRun(spec, out, cli.build_parser(), launch=launch)
    assert cells.run_matrix(matrix, progress=lambda line: None) == 0
    assert launched == []
    assert [(row.status, row.kind) for row in table.load_matrix(out).cells] == [("PASS", "resumed")]


@pytest.mark.parametrize("directory", MATRICES, ids=ids(MATRICES))
def test_an_old_matrix_compares_with_itself_under_one_judge(directory):
    result = compare_matrices(directory, directory, require_signature=True, key=configured_key())
    assert result.status == Status.NO_REGRESSION, result.text()
    assert any("judge changed: baseline:" in line for line in result.lines)


# --------------------------------------------------------------------------- a changing judge


def test_a_reworded_detail_is_presentation(tmp_path):
    def reword(payload):  # as a reworded judge would write it: checks and verdict
        for check in payload["checks"]:
            check["detail"] = "reworded: " + check["detail"]
        checks_ = [schema.Check.model_validate(check) for check in payload["checks"]]
        payload["verdict"] = seal.verdict_of(checks_).model_dump(mode="json")

    path = rewritten(CURRENT, tmp_path / "record.json", reword, redigest=True)
    loaded = record.load(path)
    judged = rejudge.rejudged(loaded)
    assert [item.kind for item in judged.judgements] == ["same"] * len(loaded.checks)
    assert compare(loaded, record.load(CURRENT)).status == Status.NO_REGRESSION


def test_the_current_fixture_is_judged_by_today_s_rules():
    """Fails when a check's result changed without its rule version bumped (the message names
    the check and its rule); regenerate with tests/fixtures/records/reseal.py after a bump."""
    loaded = record.load(CURRENT)
    assert loaded.upgraded_from is None and loaded.judge is not None
    assert all(item.kind == "same" for item in rejudge.rejudged(loaded).judgements)


def test_a_rule_changed_without_its_bump_is_refused_naming_the_rule(monkeypatch):
    monkeypatch.setattr(learning, "MIN_REFERENCE_DROP", 0.99)  # the reference now "did not learn"
    with pytest.raises(schema.RecordError) as caught:
        record.load(CURRENT)
    message = str(caught.value)
    assert "check 'learning[reference]' (rule 'learning' version 1)" in message
    assert "rule unchanged but the result differs: bump the rule version, or the record was" in (
        message
    )
    assert "status pass -> inconclusive" in message


def test_a_rule_changed_with_its_bump_is_a_judge_change(monkeypatch):
    monkeypatch.setattr(learning, "MIN_REFERENCE_DROP", 0.99)
    monkeypatch.setitem(rules.RULES, "learning", 2)
    baseline = record.load(CURRENT)  # judged by rule 1, kept as judged
    judged = rejudge.rejudged(baseline)
    assert baseline.verdict.status == "PASS" and judged.verdict.status == "INCONCLUSIVE"
    changed = [item.text() for item in judged.judge_changes]
    assert (
        "learning[reference]: PASS (rule 1) / INCONCLUSIVE under rule 2 (status pass -> "
        "inconclusive; min_reference_drop 0.02 -> 0.99)"
    ) in changed
    assert history.verdict_text(baseline).startswith(
        "PASS (as judged) / INCONCLUSIVE under today's rules: learning[reference]: PASS (rule 1)"
    )
    tonight = resealed(CURRENT)  # the same code tonight, under the new rule
    comparison = compare(baseline, tonight)
    assert comparison.status == Status.NO_REGRESSION, comparison.text()
    assert any(
        line.startswith("judge changed: check 'learning[reference]' pass in the baseline as judged")
        for line in comparison.lines
    )
    assert "judge changed: baseline: verdict PASS as judged / INCONCLUSIVE under today's rules" in (
        comparison.lines
    )


def test_a_real_regression_under_a_new_rule_still_fails(monkeypatch):
    monkeypatch.setattr(learning, "MARGIN_FACTOR", 3.5)
    monkeypatch.setitem(rules.RULES, "learning", 2)
    payload, _ = upgrade.upgrade(json.loads(CURRENT.read_text()))
    payload.pop("signature", None)
    payload["updates"][-1]["violations"] = 4  # the candidate's update broke tonight
    comparison = compare(record.load(CURRENT), seal.seal(payload))
    assert comparison.status == Status.REGRESSION
    assert any(
        line.startswith("REGRESSION: check 'update[candidate-g64]' was pass")
        for line in comparison.lines
    )
    assert any(
        line.startswith("judge changed: baseline: learning[candidate-g64]")
        for line in comparison.lines
    )


def test_a_new_check_on_an_old_record_and_an_input_its_schema_lacks(monkeypatch):
    """A family today's judge adds reads a field schema 2 never recorded: "not observed"."""

    @rules.rule("wire-v9", 1, inputs=("probes[].wire_v9",))
    def new_check(record_):
        return [
            schema.Check(name=f"wire-v9[{probe.arm}]", status="fail", detail="")
            for probe in record_.probes
        ]

    derive = checks.derive
    monkeypatch.setattr(rejudge, "derive", lambda record_: [*derive(record_), *new_check(record_)])
    try:
        loaded = record.load(FIXTURES / "a4d3357" / "run" / "record.json")
        [new] = [
            item
            for item in rejudge.rejudged(loaded).judgements
            if item.kind == "new" and item.name.startswith("wire-v9")
        ]
        assert new.today is not None and new.today.status == "n/a"
        assert new.today.detail.startswith(
            "not observed: the record's schema lacks probes[].wire_v9"
        )
        assert rejudge.rejudged(loaded).verdict.status == "PASS"
    finally:
        del rules.RULES["wire-v9"], rules.INPUTS["wire-v9"]


def test_a_tampered_old_record_is_still_refused(tmp_path):
    signed = (
        FIXTURES
        / "e0eb687"
        / "matrix"
        / "cells"
        / "qwz-s2-bf16-g64-mlp-w2-default-seed0"
        / "record.json"
    )

    def faster(payload):
        payload["performance"][0]["blocks"][0]["candidate_times_s"][0] /= 2

    edited = rewritten(signed, tmp_path / "edited.json", faster, redigest=False)
    with pytest.raises(schema.RecordError, match="digest mismatch"):
        record.load(edited)
    redigested = rewritten(signed, tmp_path / "redigested.json", faster, redigest=True)
    with pytest.raises(schema.RecordError, match="does not verify: the record was changed after"):
        record.load(redigested)
    result = compare_files(signed, edited)
    assert result.status == Status.NOT_COMPARABLE


def test_a_tampered_current_record_is_still_refused(tmp_path):
    def doctor(payload):
        payload["updates"][-1]["violations"] = 7  # the observation, checks left as they were

    path = rewritten(CURRENT, tmp_path / "record.json", doctor, redigest=True)
    with pytest.raises(schema.RecordError, match=r"update\[candidate-g64\].*rule unchanged"):
        record.load(path)


def test_an_upgraded_record_is_never_rewritten(tmp_path):
    loaded = record.load(OLD[0])
    with pytest.raises(schema.RecordError, match="never rewritten"):
        record.save(loaded, tmp_path / "record.json")


def test_a_record_of_a_newer_schema(tmp_path):
    newer = schema.SCHEMA_VERSION + 1

    def future(payload):
        payload.update(schema_version=newer, written_by_the_future=True)

    path = rewritten(CURRENT, tmp_path / "record.json", future, redigest=True)
    with pytest.raises(schema.RecordError) as caught:
        record.load(path)
    assert f"written by schema {newer}; this qwz reads up to {schema.SCHEMA_VERSION}" in str(
        caught.value
    )


def _compiled(payload):
    """The schema-3 record as a run with the fused kernels wrote it: ``"compiled"``."""
    for arm in payload["arms"]:
        if arm["role"] == "candidate":
            arm["kernels"] = "compiled"
    for own in payload["own_shards"]:
        for use in own["kernels"]:
            use["kernels"] = "compiled"


def test_a_schema_3_record_of_compiled_kernels_loads_as_fused(tmp_path):
    assert json.loads(SCHEMA_3.read_text())["schema_version"] == 3
    assert record.load(SCHEMA_3).upgraded_from == 3
    path = rewritten(SCHEMA_3, tmp_path / "record.json", _compiled, redigest=True)
    assert '"compiled"' in path.read_text()
    loaded = record.load(path)
    assert loaded.upgraded_from == 3 and loaded.schema_version == schema.SCHEMA_VERSION
    assert [arm.kernels for arm in loaded.arms] == ["eager", "eager", "fused"]
    assert {use.kernels for own in loaded.own_shards for use in own.kernels} == {"fused"}
    # The digest is checked on the bytes as written ("compiled"), before the upgrade:
    assert loaded.digest == json.loads(path.read_text())["digest"]
    edited = rewritten(SCHEMA_3, tmp_path / "edited.json", _compiled, redigest=False)
    with pytest.raises(schema.RecordError, match="digest mismatch"):
        record.load(edited)


def test_a_schema_4_record_loads_without_step_masters():
    """Schema 4 did not observe the masters after every step: loaded, it has none (what reads
    them says so, qualify/evidence/default_path.py), and its checks stand as judged."""
    assert json.loads(SCHEMA_4.read_text())["schema_version"] == 4
    loaded = record.load(SCHEMA_4)
    assert loaded.upgraded_from == 4 and loaded.step_masters == []
    current = record.load(CURRENT).verdict
    assert (loaded.verdict.status, loaded.verdict.failed) == (current.status, current.failed)


def test_a_schema_4_record_says_fused_not_compiled():
    with pytest.raises(ValueError, match="fused"):
        schema.Arm.model_validate(
            {**record.load(CURRENT).arms[-1].model_dump(), "kernels": "compiled"}
        )


def test_an_old_baseline_without_cuda_is_comparable_with_a_record_that_has_it():
    baseline = record.load(FIXTURES / "e0eb687" / "run" / "record.json")
    fresh = resealed(CURRENT)
    environment = fresh.environment.model_copy(update={"cuda": "12.4", "cpu_model": "Other CPU"})
    result = compare(
        baseline.model_copy(
            update={"environment": baseline.environment.model_copy(update={"cuda": None})}
        ),
        fresh.model_copy(update={"environment": environment}),
    )
    assert result.status == Status.NO_REGRESSION, result.text()
    assert any(line.startswith("machine.cpu_model:") for line in result.lines)
    other = environment.model_copy(update={"torch": "9.9.9"})
    refused = compare(baseline, fresh.model_copy(update={"environment": other}))
    assert refused.status == Status.NOT_COMPARABLE
    [line] = [line for line in refused.lines if "fingerprints differ" in line]
    before, after = line.split("(", 1)[1].split(")", 1)[0].split(" -> ")
    assert before != after and "environment.torch" in line


# --------------------------------------------------------------------------- the golden file


def test_the_golden_file_holds_today_s_rules_and_constants():
    stored = json.loads(judge.GOLDEN.read_text())
    assert judge.unbumped(stored) == []
    assert stored == judge.golden(), (
        "tests/unit/qualify/golden/judge-rules.json is stale: after bumping the rule, run "
        "`python -m qwz.qualify.evidence.judge GOLDEN`"
    )


def test_a_constant_changed_without_its_bump_names_the_rule(monkeypatch):
    stored = json.loads(judge.GOLDEN.read_text())
    monkeypatch.setattr(learning, "MARGIN_FACTOR", 2.5)
    [problem] = judge.unbumped(stored)
    assert problem.startswith(
        "rule 'learning': its constants changed (rules.learning.MARGIN_FACTOR) but its version "
        "did not: bump RULES['learning'] to 2"
    )
    monkeypatch.setitem(rules.RULES, "learning", 2)
    assert judge.unbumped(stored) == []  # bumped: only the golden file is stale now
    assert judge.golden() != stored


def test_the_judge_is_sealed_inside_the_digest():
    fresh = resealed(CURRENT)
    assert fresh.judge == judge.current()
    assert fresh.judge.rules == rules.RULES and set(fresh.judge.libraries) == {"scipy", "numpy"}
    body = fresh.model_dump(mode="json")
    body["judge"]["rules"]["learning"] = 9
    assert seal.canonical_digest(body) != fresh.digest


# --------------------------------------------------------------------------- the nightly's view


def _tonight(tmp_path: pathlib.Path, edit=None) -> tuple[pathlib.Path, pathlib.Path]:
    """The e0eb687 matrix as the baseline, and tonight: its cell re-sealed by today's judge
    (after ``edit`` of its observations), with the status today's verdict gives."""
    baseline = FIXTURES / "e0eb687" / "matrix"
    tonight = tmp_path / "tonight"
    shutil.copytree(baseline, tonight)
    [cell] = table.load_matrix(tonight).cells
    path = tonight / cell.record
    payload, _ = upgrade.upgrade(json.loads(path.read_text()))
    payload.pop("signature", None)
    if edit is not None:
        edit(payload)
    fresh = seal.seal(payload)
    record.save(fresh, path)
    rows = json.loads((tonight / "matrix.json").read_text())
    rows["cells"][0].update(status=fresh.verdict.status, digest=fresh.digest)
    (tonight / "matrix.json").write_text(json.dumps(rows))
    return baseline, tonight


def test_a_failure_the_baseline_shares_under_today_s_rules_is_judge_only(tmp_path, monkeypatch):
    monkeypatch.setattr(learning, "MIN_REFERENCE_DROP", 0.99)
    monkeypatch.setitem(rules.RULES, "learning", 2)
    baseline, tonight = _tonight(tmp_path)
    [(_cell, judge_only, why)] = judge_only_module.classify(baseline, tonight)
    assert judge_only, why
    assert "the baseline fails learning[reference]" in why and "under today's rules too" in why
    assert judge_only_module.main([str(baseline), str(tonight)]) == 0
    assert compare_matrices(baseline, tonight).status == Status.NO_REGRESSION


def test_a_failure_the_baseline_does_not_share_is_the_code_s(tmp_path, monkeypatch):
    monkeypatch.setitem(rules.RULES, "learning", 2)

    def break_update(payload):
        payload["updates"][-1]["violations"] = 4

    baseline, tonight = _tonight(tmp_path, break_update)
    [(_cell, judge_only, why)] = judge_only_module.classify(baseline, tonight)
    assert not judge_only and "update[candidate-g64]" in why
    assert judge_only_module.main([str(baseline), str(tonight)]) == 1


def test_a_schema_4_record_loads_without_a_ds_config_and_keeps_its_update_rule():
    """4 -> 5 names the version only: a record without ``plan.ds_config`` ran the harness's
    own config in every arm; its ``update`` checks, judged by rule 1, are kept as judged and
    today's rule 2 agrees with them (every arm ran AdamW)."""
    assert json.loads(SCHEMA_4.read_text())["schema_version"] == 4
    loaded = record.load(SCHEMA_4)
    assert loaded.upgraded_from == 4 and loaded.plan.ds_config is None
    updates = [check for check in loaded.checks if check.name.startswith("update[")]
    assert updates and {check.rule for check in updates} == {1}
    judged = rejudge.rejudged(loaded)
    assert judged.verdict.status == loaded.verdict.status


def test_a_schema_5_record_loads_as_absmax_127_and_keeps_its_own_shard_rule():
    """5 -> 6 names the version only: a record judged when absmax/127 was the contract's only
    scheme has no scheme per rank; its own-shard checks, judged by rule 2, are kept as judged,
    and today's rule 3 reads them as absmax/127 and agrees."""
    assert json.loads(SCHEMA_5.read_text())["schema_version"] == 5
    loaded = record.load(SCHEMA_5)
    assert loaded.upgraded_from == 5
    assert all(own.scheme_by_rank == [] and own.cost is None for own in loaded.own_shards)
    assert loaded.subject.substituted_ops == []
    own_checks = [check for check in loaded.checks if check.name.startswith("own-shard[")]
    assert own_checks and {check.rule for check in own_checks} == {2}
    judged = rejudge.rejudged(loaded)
    assert judged.verdict.status == loaded.verdict.status == "PASS"
    today = [item.today for item in judged.judgements if item.name.startswith("own-shard[cand")]
    assert today and all(check.status == "pass" for check in today)
    assert all(check.numbers["scheme"] == "absmax/127" for check in today)
    assert all("when it was the contract's only scheme" in check.detail for check in today)
