"""``qwz-qualify bisect`` without real qualifications: the search's rules, the oracles on
synthetic records, and whole bisects over a small git history whose trials are faked (each
writes the record a commit's behaviour calls for), so resuming, interrupting, skipping and
re-measuring are tested in seconds. tests/multigpu/test_qualify_bisect.py bisects real
qualifications of a copy of qwz."""

from __future__ import annotations

import copy
import json
import pathlib
import signal
import subprocess

import pytest

from qwz.qualify import cli
from qwz.qualify.bisect import bisect_command, oracle, search, trial, worktrees
from qwz.qualify.evidence import record as records
from qwz.qualify.run.launch import Interrupted
from tests.unit.records import CANDIDATE, make_payload, make_performance, make_record, violation

# --------------------------------------------------------------------------- the search


def _walk(first_bad: int, last: int, skipped=frozenset()) -> tuple[search.Answer, list[int]]:
    verdicts, tested = {0: "good", last: "bad"}, []
    while (index := search.next_index(verdicts, last)) is not None:
        tested.append(index)
        verdicts[index] = "skip" if index in skipped else "bad" if index >= first_bad else "good"
    return search.answer(verdicts, last), tested


@pytest.mark.parametrize("first_bad", range(1, 17))
def test_the_search_finds_every_first_bad_commit_in_log_steps(first_bad):
    answer, tested = _walk(first_bad, 16)
    assert answer == search.Answer(first_bad, [first_bad])
    assert len(tested) <= 4  # ceil(log2(16)) - the bad head, tested before


def test_a_skipped_commit_is_never_tested_again_and_its_neighbours_are():
    answer, tested = _walk(6, 8, skipped={4})
    assert tested == [4, 3, 5, 6] and answer.first_bad == 6


def test_skipped_commits_next_to_the_answer_hide_it_in_a_named_range():
    answer, tested = _walk(5, 8, skipped={4, 5})
    assert answer == search.Answer(None, [4, 5, 6])  # 6 is bad; 4 and 5 could be first
    assert 4 in tested and 5 in tested


# --------------------------------------------------------------------------- the oracles


def _own_shard_broken():
    payload = make_payload()
    payload["own_shards"][1] = {
        "arm": CANDIDATE,
        "max_ratio": 2.0,
        "first_violation": violation(1, 0, 2.0),
    }
    for item in payload["hashes"]:
        if item["arm"] == CANDIDATE:
            item["per_rank"] = ["f" * 64, "f" * 64]
    return make_record(own_shards=payload["own_shards"], hashes=payload["hashes"])


def test_the_check_oracle_by_family_and_by_name():
    good, bad = make_record(), _own_shard_broken()
    by_family = oracle.CheckOracle(("own-shard",))
    assert by_family.judge(good).verdict == "good"
    assert by_family.judge(bad).verdict == "bad"
    named = oracle.CheckOracle((f"own-shard[{CANDIDATE}]",))
    assert named.judge(bad).verdict == "bad"
    assert oracle.CheckOracle(("update",)).judge(bad).verdict == "good"
    assert oracle.unknown_check("own-shard") is None
    assert oracle.unknown_check(f"own-shard[{CANDIDATE}]") is None
    assert "names no check" in oracle.unknown_check("own_shard")


def test_an_inconclusive_run_and_a_crash_that_is_not_the_check_are_skips():
    payload = make_payload()
    flat = [{"step": s, "loss": 7.67} for s in (0, 5, 10, 15, 20)]
    for trajectory in payload["trajectories"]:
        trajectory["held_out"] = copy.deepcopy(flat)
    inconclusive = make_record(trajectories=payload["trajectories"])
    assert inconclusive.verdict.status == "INCONCLUSIVE"
    judgement = oracle.CheckOracle(("own-shard",)).judge(inconclusive)
    assert judgement.verdict == "skip" and "INCONCLUSIVE" in judgement.why
    payload = make_payload()
    payload["trajectories"][0]["failure"] = {
        "step": 3, "rank": 1, "ranks": [1], "kind": "crash",
        "message": "RuntimeError: boom", "parameters": [],
    }  # fmt: skip
    crashed = make_record(trajectories=payload["trajectories"])
    judgement = oracle.CheckOracle(("own-shard",)).judge(crashed)
    assert judgement.verdict == "skip" and "a crash that is not the check" in judgement.why
    assert oracle.CheckOracle(("finite",)).judge(crashed).verdict == "bad"


def test_the_hash_oracle_compares_every_arm_on_every_rank():
    good = make_record()
    reference = oracle.final_hashes(good)
    assert oracle.HashOracle(reference).judge(good).verdict == "good"
    assert oracle.HashOracle(reference).judge(_own_shard_broken()).verdict == "bad"
    payload = make_payload()
    payload["hashes"][0]["per_rank"] = [None, None]
    missing = make_record(hashes=payload["hashes"])
    assert oracle.HashOracle(reference).judge(missing).verdict == "skip"


def test_the_speed_oracle_below_within_and_ambiguous():
    good = oracle.speed_intervals(make_record())
    slow = make_record(performance=[make_performance(speed_scale=0.7)])
    assert oracle.SpeedOracle(good).judge(make_record()).verdict == "good"
    assert oracle.SpeedOracle(good).judge(slow).verdict == "bad"
    _, median, high = good[CANDIDATE]
    # The commit's interval reaches the good one's lower end, its median does not.
    above = {CANDIDATE: (high - 1e-9, high + 0.5, high + 1.0)}
    assert oracle.SpeedOracle(above).judge(make_record()).verdict == "ambiguous"
    at_median = {CANDIDATE: (median, median + 0.5, median + 1.0)}
    assert oracle.SpeedOracle(at_median).judge(make_record()).verdict == "good"


def test_a_re_measured_commit_pools_its_blocks():
    """Two measurements of one commit: the interval is the pooled blocks', not the latest's."""
    first = make_record(performance=[make_performance(jitter=(0.2, -0.2, 0.1, -0.1))])
    second = make_record(performance=[make_performance(jitter=(0.0, 0.01, -0.01, 0.0))])
    alone = oracle.speed_intervals(second)[CANDIDATE]
    pooled = oracle.speed_intervals(first, second)[CANDIDATE]
    assert pooled != alone
    reference = {CANDIDATE: (alone[0] - 1e-9, alone[1], alone[2])}
    judgement = oracle.SpeedOracle(reference).judge(second, (first,))
    assert "2 measurements pooled" in judgement.why


# --------------------------------------------------------------------------- whole bisects


def _git(repository: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repository), *args], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def _history(repository: pathlib.Path, behaviours: list[str]) -> list[str]:
    """A repository with one commit per behaviour (its subject); the SHAs, oldest first."""
    repository.mkdir()
    _git(repository, "init", "--quiet", "--initial-branch=main")
    _git(repository, "config", "user.email", "t@example.invalid")
    _git(repository, "config", "user.name", "t")
    shas = []
    for index, behaviour in enumerate(behaviours):
        (repository / "file.txt").write_text(f"{index}\n")
        _git(repository, "add", "-A")
        _git(repository, "commit", "--quiet", "-m", behaviour)
        shas.append(_git(repository, "rev-parse", "HEAD"))
    return shas


class FakeTrials:
    """``trial.run_trial`` replaced: each commit's subject says what its record shows."""

    def __init__(self, repository, interrupt_after=None):
        self.repository, self.interrupt_after, self.calls = repository, interrupt_after, []

    def __call__(self, request, out, attempt):
        self.calls.append(attempt.sha)
        if self.interrupt_after is not None and len(self.calls) > self.interrupt_after:
            raise Interrupted(signal.SIGTERM)
        behaviour = _git(self.repository, "log", "-1", "--format=%s", attempt.sha)
        if behaviour == "no-import":
            attempt.write_outcome({"exit_code": 1, "wall_s": 0.1, "why": "no record (exit 1)"})
            return
        built = {
            "good": make_record,
            "bad": _own_shard_broken,
            "slow": lambda: make_record(performance=[make_performance(speed_scale=0.7)]),
        }[behaviour]()
        records.save(built, attempt.record)
        attempt.write_outcome({"exit_code": 0, "wall_s": 0.1, "why": None})


HISTORY = ["good", "good", "good", "good", "no-import", "good", "bad", "bad", "bad"]


def _bisect(monkeypatch, tmp_path, fake, *flags, shas, out="out"):
    monkeypatch.setattr(trial, "run_trial", fake)
    argv = ["bisect", "--repo", str(tmp_path / "repo"), "--good", shas[0], "--bad", shas[-1],
            "--out", str(tmp_path / out), *flags, "--", "--workload", "mlp"]  # fmt: skip
    code = cli.main(argv)
    written = tmp_path / out / "bisect.json"
    return code, json.loads(written.read_text()) if written.exists() else None


def test_a_bisect_finds_the_commit_skips_one_that_does_not_import_and_resumes(
    monkeypatch, tmp_path
):
    shas = _history(tmp_path / "repo", HISTORY)
    fake = FakeTrials(tmp_path / "repo", interrupt_after=3)
    code, _ = _bisect(monkeypatch, tmp_path, fake, shas=shas)
    assert code == 128 + signal.SIGTERM
    recorded = sorted(p for p in (tmp_path / "out" / "commits").rglob("outcome.json"))
    assert len(recorded) == 3  # the interrupted fourth trial left nothing
    fake = FakeTrials(tmp_path / "repo")
    code, result = _bisect(monkeypatch, tmp_path, fake, shas=shas)
    assert code == bisect_command.FOUND and result["first_bad"]["sha"] == shas[6]
    assert (
        result["first_bad"]["subject"] == "bad" and "file.txt" in result["first_bad"]["diff_stat"]
    )
    assert not set(fake.calls) & {path.parents[1].name for path in recorded}  # none re-run
    assert result["qualifications_reused"] == 3 and result["qualifications_run"] == len(fake.calls)
    skipped = [c for c in result["tested"] if c["sha"] == shas[4]]
    assert skipped and skipped[0]["attempts"][0]["verdict"] == "skip"
    fake = FakeTrials(tmp_path / "repo")
    code, again = _bisect(monkeypatch, tmp_path, fake, shas=shas)
    assert (code, fake.calls, again["first_bad"]) == (bisect_command.FOUND, [], result["first_bad"])
    code, hashed = _bisect(
        monkeypatch, tmp_path, FakeTrials(tmp_path / "repo"), "--hash", shas=shas
    )
    assert code == bisect_command.FOUND and hashed["first_bad"]["sha"] == shas[6]
    assert "| bad |" in (tmp_path / "out" / "bisect.md").read_text()


def test_skipped_commits_that_hide_the_answer_are_named(monkeypatch, tmp_path):
    shas = _history(tmp_path / "repo", ["good", "good", "no-import", "no-import", "bad", "bad"])
    code, result = _bisect(monkeypatch, tmp_path, FakeTrials(tmp_path / "repo"), shas=shas)
    assert code == bisect_command.HIDDEN and result["first_bad"] is None
    assert [item["sha"] for item in result["candidates"]] == shas[2:5]


def test_the_speed_oracle_finds_a_slow_commit(monkeypatch, tmp_path):
    shas = _history(tmp_path / "repo", ["good", "good", "good", "slow", "slow", "slow"])
    code, result = _bisect(
        monkeypatch, tmp_path, FakeTrials(tmp_path / "repo"), "--speed", shas=shas
    )
    assert code == bisect_command.FOUND and result["first_bad"]["sha"] == shas[3]
    assert result["oracle"]["kind"] == "speed"


def test_an_ambiguous_speed_is_measured_again_then_skipped(monkeypatch, tmp_path):
    shas = _history(tmp_path / "repo", ["good", "good", "slow"])
    fake = FakeTrials(tmp_path / "repo")
    monkeypatch.setattr(trial, "run_trial", fake)
    options = bisect_command.Options(tmp_path / "repo", shas[0], shas[-1], tmp_path / "out",
                              "speed", None, 2, None, "qwz", ["--workload", "mlp"])  # fmt: skip
    _, session = bisect_command._open(options)
    good = oracle.speed_intervals(make_record())[CANDIDATE]
    # Its median just below the good head's interval, its interval reaching into it.
    ambiguous = oracle.SpeedOracle({CANDIDATE: (good[1] + 1e-9, good[1] + 0.5, good[1] + 1)})
    assert ambiguous.judge(make_record()).verdict == "ambiguous"
    judgement = session.judge(shas[1], ambiguous)
    assert judgement.verdict == "skip" and "ambiguous after 3 measurements" in judgement.why
    assert fake.calls == [shas[1]] * 3


def test_refusals_and_nothing_to_find(monkeypatch, tmp_path, capsys):
    shas = _history(tmp_path / "repo", ["bad", "good", "bad", "good"])
    fake = FakeTrials(tmp_path / "repo")
    code, result = _bisect(monkeypatch, tmp_path, fake, shas=shas[:3])
    assert code == bisect_command.REFUSED and "the good head" in result["why"]  # it fails the check
    code, result = _bisect(monkeypatch, tmp_path, fake, shas=shas[1:], out="out2")
    assert code == bisect_command.NOTHING and "passes every check" in result["why"]
    code, _ = _bisect(monkeypatch, tmp_path, fake, shas=shas[1:], out="out2")
    assert code == bisect_command.NOTHING  # the same request resumes
    code, _ = _bisect(monkeypatch, tmp_path, fake, shas=[shas[0], shas[1]], out="out2")
    assert code == bisect_command.REFUSED and "another request" in capsys.readouterr().err
    code, _ = _bisect(monkeypatch, tmp_path, fake, shas=[shas[2], shas[1]], out="out3")
    assert code == bisect_command.REFUSED and "nothing lies between" in capsys.readouterr().err
    argv = ["bisect", "--repo", str(tmp_path / "repo"), "--good", shas[0], "--bad", shas[1],
            "--out", str(tmp_path / "o4"), "--", "--out", "x"]  # fmt: skip
    assert cli.main(argv) == 2 and "--out is the bisect's to set" in capsys.readouterr().err
    assert cli.main([*argv[:-2], "--steps", "0"]) == 2
    assert "--steps: 0 is invalid" in capsys.readouterr().err
    assert cli.main([*argv[:-3], "--check", "no-such", "--", "--workload", "mlp"]) == 2
    assert "names no check" in capsys.readouterr().err
    repository = tmp_path / "repo"
    argv = ["bisect", "--repo", str(repository), "--good", "nosuchbase", "--bad", shas[1],
            "--out", str(tmp_path / "o5"), "--", "--workload", "mlp"]  # fmt: skip
    assert cli.main(argv) == 2  # a sentence, not the git command that failed
    assert capsys.readouterr().err == (
        f"qwz-qualify bisect: error: --good nosuchbase is not a commit in {repository}\n"
    )
    argv[2] = str(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"qwz-qualify bisect: error: --repo {tmp_path} is not a git repository\n"
    )


def test_a_good_head_off_the_first_parent_line_is_refused(tmp_path):
    from qwz.qualify.bisect import first_parents

    shas = _history(tmp_path / "repo", ["good", "good"])
    _git(tmp_path / "repo", "checkout", "--quiet", "-b", "side", shas[0])
    (tmp_path / "repo" / "side.txt").write_text("side\n")
    _git(tmp_path / "repo", "add", "-A")
    _git(tmp_path / "repo", "commit", "--quiet", "-m", "side")
    side = _git(tmp_path / "repo", "rev-parse", "HEAD")
    _git(tmp_path / "repo", "checkout", "--quiet", "main")
    _git(tmp_path / "repo", "merge", "--quiet", "--no-ff", "-m", "merge", "side")
    head = _git(tmp_path / "repo", "rev-parse", "HEAD")
    assert first_parents.first_parent_range(tmp_path / "repo", shas[0], head) == [
        *shas[:1],
        shas[1],
        head,
    ]
    with pytest.raises(first_parents.GitError, match="not on the first-parent history"):
        first_parents.first_parent_range(tmp_path / "repo", side, head)


def test_a_directory_bisected_by_another_harness_is_refused(monkeypatch, tmp_path, capsys):
    """Records judged by one harness are never reused under another ([Note: the judge is the
    bisecting head's])."""
    shas = _history(tmp_path / "repo", HISTORY)
    code, _ = _bisect(monkeypatch, tmp_path, FakeTrials(tmp_path / "repo"), shas=shas)
    assert code == bisect_command.FOUND
    monkeypatch.setattr(worktrees, "harness_digest", lambda: "0" * 64)
    code, _ = _bisect(monkeypatch, tmp_path, FakeTrials(tmp_path / "repo"), shas=shas)
    assert code == bisect_command.REFUSED and "harness_digest differ" in capsys.readouterr().err


def test_a_trial_worktree_never_touches_the_users_tree(tmp_path):
    """A DeepSpeed subject gets the worktree as --deepspeed-src (no harness copied in), --setup
    runs there, a failing setup is "not buildable", a qwz subject without a qwz/ package is
    "not importable", and the user's checkout keeps its HEAD and a clean status."""
    from qwz.qualify.bisect import state

    shas = _history(tmp_path / "repo", ["one", "two"])
    (tmp_path / "repo" / "file.txt").write_text("the user's uncommitted edit\n")
    request = {"repository": str(tmp_path / "repo"), "subject": "deepspeed-native",
               "setup": "touch built", "run_args": []}  # fmt: skip
    out = tmp_path / "out"
    worktree, extra = trial._prepare(request, out, shas[0], state.next_attempt(out, shas[0]))
    assert extra == ["--deepspeed-src", str(worktree)]
    assert (worktree / "built").exists() and (worktree / "file.txt").read_text() == "0\n"
    assert not (worktree / "qwz").exists()
    failing = {**request, "setup": "echo no compiler >&2; exit 3"}
    _, why = trial._prepare(failing, out, shas[1], state.next_attempt(out, shas[1]))
    assert why == "not buildable: --setup exited 3: no compiler"
    _, why = trial._prepare({**request, "subject": "qwz", "setup": None}, out, shas[1],
                            state.next_attempt(out, shas[1]))  # fmt: skip
    assert why == "not importable: the commit has no qwz/ package"
    assert _git(tmp_path / "repo", "rev-parse", "HEAD") == shas[-1]
    assert _git(tmp_path / "repo", "status", "--porcelain") == "M file.txt"
    assert (tmp_path / "repo" / "file.txt").read_text() == "the user's uncommitted edit\n"


def test_a_qwz_commit_is_qualified_by_the_bisecting_harness(tmp_path):
    """[Note: the judge is the bisecting head's]: the commit's own qwz/qualify is replaced by
    the snapshot; the rest of its qwz (the code under test) stays the commit's."""
    from qwz.qualify.bisect import state

    repository = tmp_path / "repo"
    shas = _history(repository, ["one"])
    (repository / "qwz" / "qualify").mkdir(parents=True)
    (repository / "qwz" / "__init__.py").write_text("ENGINE = 'the commit'\n")
    (repository / "qwz" / "qualify" / "__init__.py").write_text("JUDGE = 'the commit'\n")
    _git(repository, "add", "-A")
    _git(repository, "commit", "--quiet", "-m", "a qwz package")
    sha = _git(repository, "rev-parse", "HEAD")
    out = tmp_path / "out"
    worktrees.snapshot_harness(out)
    request = {"repository": str(repository), "subject": "qwz", "setup": None, "run_args": []}
    worktree, extra = trial._prepare(request, out, sha, state.next_attempt(out, sha))
    assert extra == [] and shas[0] != sha
    assert (worktree / "qwz" / "__init__.py").read_text() == "ENGINE = 'the commit'\n"
    judge = worktree / "qwz" / "qualify"
    assert "the commit" not in (judge / "__init__.py").read_text()
    assert worktrees.harness_digest(judge) == worktrees.harness_digest()


def test_an_interrupted_attempt_is_run_again_over_what_it_left(monkeypatch, tmp_path):
    """An interrupted trial's run leaves interrupted.json ([Note: unfinished runs]), which run's
    preflight refuses to replace without --force ([Note: results kept]): the trial's own run,
    in the bisect's own attempt directory, replaces it, so a resumed bisect runs it again."""
    from qwz.qualify.bisect import state
    from qwz.qualify.request import preflight, run_request

    out, sha = tmp_path / "out", "a" * 40
    attempt = state.next_attempt(out, sha)
    (attempt.directory / "interrupted.json").write_text('{"verdict": null}')
    assert state.next_attempt(out, sha).directory == attempt.directory  # no record, no outcome
    commands = []

    def qualify(command_line, cwd, env, log):
        commands.append(command_line)
        return 2

    monkeypatch.setattr(trial, "_prepare", lambda request, out, sha, attempt: (tmp_path, []))
    monkeypatch.setattr(trial, "_run_logged", qualify)
    monkeypatch.setattr(worktrees, "remove", lambda repository, worktree: None)
    monkeypatch.setattr(trial, "_last_line", lambda log: "")
    request = {"repository": str(tmp_path), "subject": "qwz", "setup": None,
               "run_args": ["--workload", "mlp"]}  # fmt: skip
    trial.run_trial(request, out, attempt)
    [run] = commands
    args = cli.build_parser().parse_args(run[run.index("qwz.qualify") + 1 :])
    assert preflight._output_problems(run_request.resolve(args)) == []
