"""``qwz-qualify bisect`` and ``qwz-qualify bisect-step``: the request checked, the oracle
fixed by the good and bad heads, the search walked, the result written.

Exit codes ([Note: exit statuses] in qualify/base/exit_codes.py): ``bisect`` 0 the first bad
commit was found, 2 refused (with why: a bad revision, a range that is not first-parent
history, a good head that is not good, a bad head that is not bad for the oracle -- "nothing
to find", written to bisect.md --, a head that cannot be qualified, a directory of another
request), 3 skipped commits hide the answer (bisect.md names the range), 128 + signal when
SIGINT/SIGTERM stopped it (every record is kept).
``bisect-step`` (a ``git bisect run`` command): 0 good, 1 bad, 125 skip, 128 when the request
is refused or there is nothing to find (git aborts the bisect on exit codes above 127).
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any, NamedTuple

from qwz.qualify.base import exit_codes
from qwz.qualify.bisect import first_parents, oracle, result, search, state, trial, worktrees
from qwz.qualify.evidence import record as records
from qwz.qualify.evidence.schema import Record, RecordError

FOUND = exit_codes.PASS
NOTHING = exit_codes.REFUSED
"""The bad head is not bad: the request's premise is false, as with a good head that is not
good (no command gives 1 but for the subject's failure)."""
REFUSED = exit_codes.REFUSED
HIDDEN = exit_codes.INCONCLUSIVE
STEP_GOOD, STEP_BAD = exit_codes.GIT_BISECT_GOOD, exit_codes.GIT_BISECT_BAD
STEP_SKIP, STEP_ABORT = exit_codes.GIT_BISECT_SKIP, exit_codes.GIT_BISECT_ABORT


class Refused(Exception):
    """The request cannot be answered; the message says why (exit 2)."""


class NothingToFind(Exception):
    """The bad head is not bad for the oracle (exit 2, "nothing to find")."""


class Options(NamedTuple):
    repository: pathlib.Path
    good: str
    bad: str
    out: pathlib.Path
    oracle: str
    """"default", "check", "hash" or "speed"."""
    check: str | None
    speed_retries: int
    setup: str | None
    subject: str
    run_args: list[str]


def _say(text: str) -> None:
    print(f"qwz-qualify bisect: {text}", file=sys.stderr, flush=True)


def _refuse(command: str, problem: object) -> None:
    """[Note: one error style] (qualify/cli_parser.py), which this layer does not import."""
    print(f"qwz-qualify {command}: error: {problem}", file=sys.stderr, flush=True)


class Session:
    """The trials of one invocation: attempts reused from the directory or run now."""

    def __init__(self, request: dict[str, Any], out: pathlib.Path, speed_retries: int):
        self.request, self.out, self.speed_retries = request, out, speed_retries
        self.ran = 0
        self.run_now: set[pathlib.Path] = set()
        self.reused_from_before: set[pathlib.Path] = set()
        self.tested: dict[str, list[dict[str, Any]]] = {}

    def _attempt(self, sha: str, number: int) -> state.Attempt:
        """The `number`-th (0-based) finished attempt of `sha`, run now if there is none."""
        finished = state.attempts(self.out, sha)
        if number < len(finished):
            if finished[number].directory not in self.run_now:
                self.reused_from_before.add(finished[number].directory)
            return finished[number]
        attempt = state.next_attempt(self.out, sha)
        _say(f"qualifying {sha[:12]} ({attempt.directory.name}) ...")
        trial.run_trial(self.request, self.out, attempt)
        self.ran += 1
        self.run_now.add(attempt.directory)
        return attempt

    def record(self, sha: str, number: int = 0) -> tuple[state.Attempt, Record | str]:
        """The attempt and its record, or why it has none (it is a skip)."""
        attempt = self._attempt(sha, number)
        if not attempt.record.is_file():
            return attempt, attempt.outcome().get("why") or "no record"
        try:
            return attempt, records.load(attempt.record)
        except RecordError as error:
            return attempt, f"the record does not load: {error}"

    def judge(self, sha: str, judge_by) -> oracle.Judgement:
        """`sha`'s verdict; an ambiguous one is measured again, up to --speed-retries times,
        its measurements pooled ([Note: speed verdicts] in qualify/bisect/oracle.py), then
        skipped. Every attempt is noted for the result."""
        entries = self.tested.setdefault(sha, [])
        entries.clear()
        measured: list[Record] = []
        for number in range(1 + self.speed_retries):
            attempt, loaded = self.record(sha, number)
            if isinstance(loaded, str):
                judgement = oracle.Judgement("skip", loaded)
            elif isinstance(judge_by, oracle.SpeedOracle):
                judgement = judge_by.judge(loaded, tuple(measured))
                measured.append(loaded)
            else:
                judgement = judge_by.judge(loaded)
            entries.append(_entry(attempt, loaded, judgement))
            if judgement.verdict != "ambiguous":
                return judgement
        return oracle.Judgement(
            "skip", f"ambiguous after {len(entries)} measurements: {judgement.why}"
        )


def _entry(attempt: state.Attempt, loaded, judgement: oracle.Judgement) -> dict[str, Any]:
    outcome = attempt.outcome()
    return {
        "attempt": attempt.directory.name,
        "record": str(attempt.record) if attempt.record.is_file() else None,
        "digest": None if isinstance(loaded, str) else loaded.digest,
        "verdict": judgement.verdict,
        "why": judgement.why,
        "exit_code": outcome.get("exit_code"),
        "wall_s": outcome.get("wall_s"),
    }


def _resolve(options: Options) -> tuple[pathlib.Path, str, str]:
    """The repository's root and the full SHAs of the good and bad heads. (bisect-step takes
    them as given too: git moves refs/bisect/* as it goes, and the references of the oracle
    must stay the same commits for every step.)"""
    try:
        repository = first_parents.top_level(options.repository)
    except first_parents.GitError:
        raise Refused(f"--repo {options.repository} is not a git repository") from None
    shas = []
    for flag, revision in (("--good", options.good), ("--bad", options.bad)):
        try:
            shas.append(first_parents.commit_sha(repository, revision))
        except first_parents.GitError:
            raise Refused(f"{flag} {revision} is not a commit in {repository}") from None
    return repository, shas[0], shas[1]


def _request(options: Options, repository: pathlib.Path, good: str, bad: str) -> dict[str, Any]:
    return {
        "repository": str(repository),
        "good": good,
        "bad": bad,
        "subject": options.subject,
        "run_args": list(options.run_args),
        "setup": options.setup,
        "harness_digest": worktrees.harness_digest(),
    }


def _open(options: Options) -> tuple[dict[str, Any], Session]:
    repository, good, bad = _resolve(options)
    if options.oracle == "check" and (problem := oracle.unknown_check(options.check or "")):
        raise Refused(problem)
    request = _request(options, repository, good, bad)
    try:
        resumed = state.claim(options.out, request)
    except state.RequestError as error:
        raise Refused(str(error)) from None
    worktrees.snapshot_harness(options.out)
    if resumed:
        _say(f"resuming the bisect in {options.out} (finished attempts are reused)")
    return request, Session(request, options.out, options.speed_retries)


def _must_be(session: Session, sha: str, role: str, judge_by, wanted: str) -> None:
    """Refuse (good head) or find nothing (bad head) unless `sha` judges `wanted`."""
    judgement = session.judge(sha, judge_by)
    if judgement.verdict == wanted:
        return
    if role == "bad" and judgement.verdict == "good":
        raise NothingToFind(f"the bad head {sha[:12]} is good for the oracle: {judgement.why}")
    raise Refused(f"the {role} head {sha[:12]} is not {wanted} for the oracle "
                  f"({judgement.verdict}): {judgement.why}")  # fmt: skip


def _default_oracle(session: Session, good: str, bad: str) -> oracle.CheckOracle:
    """The checks that failed in the bad head's record; the good head must pass them."""
    _, loaded = session.record(bad)
    if isinstance(loaded, str):
        raise Refused(f"the bad head {bad[:12]} could not be qualified: {loaded}")
    if loaded.verdict.status == "PASS":
        raise NothingToFind(f"the bad head {bad[:12]} passes every check: no check to search")
    if not loaded.verdict.failed:
        inconclusive = ", ".join(loaded.verdict.inconclusive)
        raise Refused(
            f"the bad head {bad[:12]} failed no check ({loaded.verdict.status}: {inconclusive})"
        )
    judge_by = oracle.CheckOracle(tuple(loaded.verdict.failed))
    session.judge(bad, judge_by)  # noted for the result
    _must_be(session, good, "good", judge_by, "good")
    return judge_by


def _reference(session: Session, good: str, read, what: str):
    _, loaded = session.record(good)
    if isinstance(loaded, str):
        raise Refused(f"the good head {good[:12]} could not be qualified: {loaded}")
    reference = read(loaded)
    if isinstance(reference, str):
        raise Refused(f"the good head {good[:12]} has no {what}: {reference}")
    return reference


def build_oracle(options: Options, session: Session, good: str, bad: str):
    """The oracle, with the good and bad heads qualified and judged as they must be."""
    if options.oracle == "default":
        return _default_oracle(session, good, bad)
    if options.oracle == "check":
        judge_by = oracle.CheckOracle((options.check,))
    elif options.oracle == "hash":
        judge_by = oracle.HashOracle(_reference(session, good, oracle.final_hashes, "final hash"))
    else:
        intervals = _reference(session, good, oracle.speed_intervals, "speed-up interval")
        judge_by = oracle.SpeedOracle(intervals)
    _must_be(session, good, "good", judge_by, "good")
    _must_be(session, bad, "bad", judge_by, "bad")
    return judge_by


def _walk(session: Session, commits: list[str], judge_by) -> search.Answer:
    last = len(commits) - 1
    verdicts = {0: "good", last: "bad"}
    while (index := search.next_index(verdicts, last)) is not None:
        judgement = session.judge(commits[index], judge_by)
        verdicts[index] = judgement.verdict
        good, bad = search.bounds(verdicts, last)
        _say(f"{commits[index][:12]} ({index}/{last}) {judgement.verdict}: {judgement.why} "
             f"[{bad - good - 1} commits left between the bounds]")  # fmt: skip
    return search.answer(verdicts, last)


def run_bisect(options: Options) -> int:
    started = time.monotonic()
    try:
        request, session = _open(options)
    except Refused as error:
        _refuse("bisect", error)
        return REFUSED
    repository = pathlib.Path(request["repository"])
    summary = result.Summary(request, options.out, started)
    try:
        commits = first_parents.first_parent_range(repository, request["good"], request["bad"])
        judge_by = build_oracle(options, session, request["good"], request["bad"])
        answer = _walk(session, commits, judge_by)
    except (Refused, first_parents.GitError) as error:
        return summary.write(session, "refused", str(error), REFUSED)
    except NothingToFind as error:
        return summary.write(session, "nothing to find", str(error), NOTHING)
    summary.oracle = judge_by.describe()
    if answer.first_bad is not None:
        summary.found(commits[answer.first_bad])
        return summary.write(session, "found", "", FOUND)
    summary.hidden([commits[index] for index in answer.candidates])
    return summary.write(session, "hidden by skipped commits", "", HIDDEN)


def run_step(options: Options) -> int:
    """One ``git bisect run`` step: judge the repository's HEAD (qualified in a worktree, so
    the checkout git bisect made is only read)."""
    try:
        request, session = _open(options)
        judge_by = build_oracle(options, session, request["good"], request["bad"])
        sha = first_parents.commit_sha(pathlib.Path(request["repository"]), "HEAD")
    except (Refused, NothingToFind, first_parents.GitError) as error:
        _refuse("bisect-step", f"{error} (exit {STEP_ABORT}: git aborts the bisect)")
        return STEP_ABORT
    judgement = session.judge(sha, judge_by)
    _say(f"{sha[:12]} {judgement.verdict}: {judgement.why}")
    return {"good": STEP_GOOD, "bad": STEP_BAD}.get(judgement.verdict, STEP_SKIP)
