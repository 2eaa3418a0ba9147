"""``qwz-qualify review`` (qwz/qualify/pr_review/) through a fake ``run``: the request and its
refusals, the two runs' arguments, resume ([Note: review resume]), a changed request, a run's
refusal, a stop, the summary and the exit status. The real review, on a DeepSpeed checkout, is
tests/multigpu/test_qualify_review.py."""

from __future__ import annotations

import json
import pathlib
import signal

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import record as record_io
from qwz.qualify.evidence import seal
from qwz.qualify.matrix import cells
from qwz.qualify.pr_review import review_command
from qwz.qualify.review import pr_review
from tests.deepspeed_checkout import git
from tests.extras import NEEDS_TRANSFORMERS
from tests.unit.records import conformance_table, make_payload, make_step_masters

PARSER = cli.build_parser()
RUN_OPTIONS = ["--workload", "mlp", "--steps", "4"]


@pytest.fixture
def repository(tmp_path) -> tuple[pathlib.Path, str, str]:
    """A repository of two commits: (its root, the base SHA, the head SHA)."""
    root = tmp_path / "DeepSpeed"
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text("version = 'base'\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    base = git(root, "rev-parse", "HEAD").strip()
    (root / "deepspeed" / "__init__.py").write_text("version = 'head'\n")
    git(root, "commit", "-q", "-am", "head")
    return root, base, git(root, "rev-parse", "HEAD").strip()


class FakeRun:
    """Stands in for ``python -m qwz.qualify run``: notes every launch and writes a record of
    the plan the arguments ask for, bound to the commit checked out in ``--deepspeed-src``
    (``edits[side](payload)`` changes it; ``codes[side]`` is the exit status)."""

    def __init__(self, codes=None, edits=None, stderr=None, during=None) -> None:
        self.launched: list[list[str]] = []
        self.codes, self.edits = codes or {}, edits or {}
        self.stderr, self.during = stderr or {}, during or {}

    def __call__(self, argv, logs, stop) -> int:
        self.launched.append(argv)
        out = pathlib.Path(argv[argv.index("--out") + 1])
        side = out.name
        logs.stderr.write_text(self.stderr.get(side, ""))
        if side in self.during:
            self.during[side](stop)
        code = self.codes.get(side, 0)
        if code in (0, 1, 3):
            source = pathlib.Path(argv[argv.index("--deepspeed-src") + 1])
            sha = git(source, "rev-parse", "HEAD").strip()
            payload = make_payload(
                plan=cells.expected_plan(PARSER, argv[1 : argv.index("--out")]),
                head={"repository": "DeepSpeed", "sha": sha, "dirty": False},
                step_masters=make_step_masters(),
            )
            self.edits.get(side, lambda payload: None)(payload)
            record_io.save(seal.seal(payload), out / "record.json")
        return code

    def arguments(self, side: str) -> list[str]:
        argv = next(argv for argv in self.launched if f"/{side}" in argv[argv.index("--out") + 1])
        return argv[1 : argv.index("--out")]


def review(tmp_path, repository, fake: FakeRun, *extra: str, out: str = "review") -> int:
    root, base, head = repository
    argv = ["review", "--repo", str(root), "--base", base, "--head", head]
    args = PARSER.parse_args([*argv, "--out", str(tmp_path / out), *extra])
    return review_command.run_review(args, PARSER, launcher=fake)


def summary(tmp_path, out: str = "review") -> dict:
    return json.loads((tmp_path / out / pr_review.JSON).read_text())


def test_the_base_runs_the_reference_alone_and_the_head_every_arm(tmp_path, repository):
    fake = FakeRun()
    assert review(tmp_path, repository, fake, *RUN_OPTIONS, "--", "--min-speedup", "1.02") == 0
    worktree = str((tmp_path / "review" / "worktree").absolute())
    common = [*RUN_OPTIONS, "--group-size", "64", "--group-size", "8192"]
    source = ["--subject", "deepspeed-native", "--deepspeed-src", worktree]
    assert fake.arguments("base") == [*common, *source, "--arm-set", "reference"]
    assert fake.arguments("head") == [*common, *source, "--arm-set", "all", "--min-speedup", "1.02"]
    data = summary(tmp_path)
    assert (data["status"], data["exit_code"]) == ("PASS", 0)
    assert [(run["side"], run["kind"], run["status"]) for run in data["runs"]] == [
        ("base", "ran", "PASS"),
        ("head", "ran", "PASS"),
    ]
    assert [run["sha"] for run in data["runs"]] == list(repository[1:])
    assert data["default_path"]["status"] == "pass"
    markdown = (tmp_path / "review" / pr_review.MARKDOWN).read_text()
    assert "| default path unchanged | `default-path`, `conformance` | **PASS** |" in markdown
    assert "[base/record.json](base/record.json)" in markdown


def test_a_finished_review_runs_nothing_again(tmp_path, repository):
    assert review(tmp_path, repository, FakeRun(), *RUN_OPTIONS) == 0
    again = FakeRun()
    assert review(tmp_path, repository, again, *RUN_OPTIONS) == 0
    assert again.launched == []
    assert [run["kind"] for run in summary(tmp_path)["runs"]] == ["resumed", "resumed"]


def test_a_run_without_a_finished_record_of_its_commit_runs_again(tmp_path, repository):
    assert review(tmp_path, repository, FakeRun(), *RUN_OPTIONS) == 0
    head = tmp_path / "review" / "head" / "record.json"
    payload = json.loads(head.read_text())
    payload["head"]["sha"] = repository[1]  # the base's commit in the head's place
    record_io.save(seal.seal({k: v for k, v in payload.items() if k != "digest"}), head)
    again = FakeRun()
    assert review(tmp_path, repository, again, *RUN_OPTIONS) == 0
    assert [pathlib.Path(argv[argv.index("--out") + 1]).name for argv in again.launched] == ["head"]


@NEEDS_TRANSFORMERS
def test_a_changed_request_is_refused_unless_restarted(tmp_path, repository, capsys):
    assert review(tmp_path, repository, FakeRun(), *RUN_OPTIONS) == 0
    changed = FakeRun()
    assert review(tmp_path, repository, changed, "--workload", "mlp", "--steps", "5") == 2
    assert changed.launched == []
    said = capsys.readouterr().err
    assert "holds a review of another request (run_args differ" in said and "--restart" in said
    assert review(tmp_path, repository, changed, "--steps", "5", "--restart") == 0
    assert len(changed.launched) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--", "--out", "x"], "--out is the review's to set, not a run option"),
        (["--", "--force"], "--force is the review's to set, not a run option"),
        (["--", "--subject", "qwz"], "--subject is the review's to set"),
        (["--", "--arm-set", "all"], "--arm-set is the review's to set"),
        (["--", "--deepspeed-src", "/x"], "--deepspeed-src is the review's to set"),
        (["--", "--steps", "0"], "argument --steps: 0 is invalid: must be a positive integer"),
        (["--worktree", "."], "is not a worktree of"),
    ],
)
def test_a_bad_request_is_refused_before_anything_runs(
    tmp_path, repository, capsys, extra, message
):
    fake = FakeRun()
    assert review(tmp_path, repository, fake, *extra) == 2
    assert fake.launched == [] and message in capsys.readouterr().err


def test_the_repositorys_own_checkout_is_never_the_worktree(tmp_path, repository, capsys):
    assert review(tmp_path, repository, FakeRun(), "--worktree", str(repository[0])) == 2
    assert "the repository's own checkout" in capsys.readouterr().err


def test_review_settings_given_as_flags_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        PARSER.parse_args(["review", "--repo", ".", "--base", "a", "--head", "b", "--out", "o",
                           "--deepspeed-src", "/x"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "--deepspeed-src is the review's to set" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("base", "head", "message"), [("nope", "HEAD", "nope"), ("HEAD", "HEAD", "one commit")]
)
def test_refs_that_do_not_name_two_commits_are_refused(
    tmp_path, repository, capsys, base, head, message
):
    root = repository[0]
    args = PARSER.parse_args(["review", "--repo", str(root), "--base", base, "--head", head,
                              "--out", str(tmp_path / "o")])  # fmt: skip
    assert review_command.run_review(args, PARSER, launcher=FakeRun()) == 2
    assert message in capsys.readouterr().err


def test_a_refused_run_refuses_the_review(tmp_path, repository):
    refusal = "qwz-qualify run: error: --group-size 8192: DeepSpeed refuses the key\n"
    fake = FakeRun(codes={"base": 2}, stderr={"base": refusal})
    assert review(tmp_path, repository, fake, *RUN_OPTIONS) == 2
    runs = summary(tmp_path)["runs"]
    assert [(run["side"], run["status"]) for run in runs] == [
        ("base", "refused"),
        ("head", "not run"),
    ]
    assert runs[0]["reason"] == "refused by run: --group-size 8192: DeepSpeed refuses the key"


def test_a_changed_default_path_fails_the_review(tmp_path, repository):
    def nudge(payload):
        payload["trajectories"][0]["losses"][2] += 1e-9

    assert review(tmp_path, repository, FakeRun(edits={"head": nudge}), *RUN_OPTIONS) == 1
    data = summary(tmp_path)
    assert data["status"] == "FAIL" and data["default_path"]["first"]["step"] == 3


def test_the_bases_config_rules_are_context_but_its_reference_is_judged(tmp_path, repository):
    """Stock DeepSpeed at the base FAILs the PR's config rules by design: that is context (the
    claims table shows it), never the review's FAIL; a base whose reference arm fails is."""

    def stock(payload):
        payload["conformance"] = conformance_table("deepspeed-native-stock")

    assert review(tmp_path, repository, FakeRun(edits={"base": stock}), *RUN_OPTIONS) == 0
    assert [run["status"] for run in summary(tmp_path)["runs"]] == ["PASS", "PASS"]

    def not_finite(payload):
        stock(payload)
        payload["trajectories"][0]["losses"][1] = None

    fake = FakeRun(edits={"base": not_finite})
    assert review(tmp_path, repository, fake, *RUN_OPTIONS, out="broken") == 1
    base = summary(tmp_path, "broken")["runs"][0]
    assert base["status"] == "FAIL" and "conformance" not in base["reason"]


def test_a_harness_error_is_not_a_fail(tmp_path, repository):
    assert review(tmp_path, repository, FakeRun(codes={"head": 4}), *RUN_OPTIONS) == 4
    data = summary(tmp_path)
    assert data["runs"][1]["status"] == "HARNESS-ERROR"
    # No claim of the qualification; the own tests' rows say the PR changes no test.
    assert [(row["claim"], row["verdict"]) for row in data["claims"]] == [
        ("the PR's own tests collect at its head", "no tests"),
        ("the PR's own tests pass at its head", "no tests"),
    ]


def test_a_stop_keeps_what_finished_and_the_same_command_continues(tmp_path, repository):
    def sigterm(stop):
        stop.handle(signal.SIGTERM, None)

    fake = FakeRun(codes={"head": 128 + signal.SIGTERM}, during={"head": sigterm})
    assert review(tmp_path, repository, fake, *RUN_OPTIONS) == 128 + signal.SIGTERM
    runs = summary(tmp_path)["runs"]
    assert [run["status"] for run in runs] == ["PASS", "interrupted"]
    again = FakeRun()
    assert review(tmp_path, repository, again, *RUN_OPTIONS) == 0
    assert [pathlib.Path(argv[argv.index("--out") + 1]).name for argv in again.launched] == ["head"]


def test_each_ref_that_names_no_commit_is_refused_in_a_sentence(tmp_path, repository, capsys):
    root = repository[0]
    args = PARSER.parse_args(["review", "--repo", str(root), "--base", "nosuchbase", "--head",
                              "nosuchhead", "--out", str(tmp_path / "o")])  # fmt: skip
    fake = FakeRun()
    assert review_command.run_review(args, PARSER, launcher=fake) == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"qwz-qualify review: refused: --base nosuchbase is not a commit in {root}",
        f"qwz-qualify review: refused: --head nosuchhead is not a commit in {root}",
    ]
    assert fake.launched == [] and not (tmp_path / "o").exists()


def _review_help(capsys) -> str:
    """``qwz-qualify review --help`` as the command's own parser prints it."""
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["review", "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "extra", [["--qwz-gather"], ["--no-qwz-gather"], ["--", "--no-qwz-gather"]]
)
def test_qwz_gather_is_refused_as_it_cannot_apply(tmp_path, repository, capsys, extra):
    """Every arm of a review is DeepSpeed's own code: the flag would be silently moot."""
    fake = FakeRun()
    if extra[0] != "--":
        with pytest.raises(SystemExit) as exit_info:
            review(tmp_path, repository, fake, *extra)
        assert exit_info.value.code == 2
    else:
        assert review(tmp_path, repository, fake, *extra) == 2
    assert fake.launched == []
    assert "qwz-gather does not apply to a review" in capsys.readouterr().err


def test_review_help_shows_the_group_sizes_the_review_uses_and_no_qwz_gather(capsys):
    text = _review_help(capsys)
    assert "qwz-gather" not in text
    assert "candidate group size; repeat for several arms (default: 64 8192, the PR's own" in text


def _worktrees(root: pathlib.Path) -> list[str]:
    listed = git(root, "worktree", "list", "--porcelain").splitlines()
    return [line.split(" ", 1)[1] for line in listed if line.startswith("worktree ")]


@pytest.mark.parametrize("codes", [{}, {"base": 2}, {"head": 4}])
def test_the_reviews_own_worktree_is_removed_however_it_ends(tmp_path, repository, codes):
    root = repository[0]
    refusal = {"base": "qwz-qualify run: error: --steps: no\n"}
    review(tmp_path, repository, FakeRun(codes=codes, stderr=refusal), *RUN_OPTIONS)
    assert _worktrees(root) == [str(root)]
    assert not (tmp_path / "review" / "worktree").exists()
    assert (tmp_path / "review" / pr_review.JSON).is_file()


def test_a_worktree_the_user_named_is_kept(tmp_path, repository):
    root, worktree = repository[0], tmp_path / "shared-worktree"
    assert review(tmp_path, repository, FakeRun(), *RUN_OPTIONS, "--worktree", str(worktree)) == 0
    assert _worktrees(root) == [str(root), str(worktree)]
