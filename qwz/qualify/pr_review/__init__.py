"""``qwz-qualify review``: a DeepSpeed pull request against its base, in one command.

Given a DeepSpeed repository and two refs (a branch, a commit, ``pull/N/head`` fetched by the
user), the review resolves both to SHAs, checks each out in one worktree of its own and
qualifies it as ``qwz-qualify run --subject deepspeed-native --deepspeed-src <worktree>``:
the base with the reference arm alone, the head with every arm (the PR's group sizes, 64
and 8192, unless the run options name others). It then writes one report whose top is the
claims table (qualify/review/claims.py): each bullet of the PR's summary with the checks that
decide it, "default path unchanged" among them (qualify/evidence/default_path.py).

It also runs the PR's own tests at the head, beside that independent judge, and the same
test files on the base's code as context ([Note: the PR's own tests] in own_tests.py): two
rows of the claims table, and the line beside the verdict.

One file per job: ``request`` (the run options, what the review sets itself, the request on
disk and its resume), ``checkout`` (the worktree), ``children`` (one ``run`` as a child
process, or its finished record reused), ``test_files`` (which files are the PR's tests),
``own_tests`` (running them), ``test_log`` (how one test file's pytest ended, from
``pytest_plugin/``'s events) and ``review_command`` (the command).

[Note: the base runs the reference alone]
The PR's default path is the reference arm (``zero_quantized_weights: false``): it must be the
same at the head as at the base, bit for bit. The base's candidates would say nothing about
the PR (stock DeepSpeed ignores the key at stages 1/2, and refuses a group size), so the base
runs ``--arm-set reference``: the reference alone, timed against itself so its step times are
there as context for the head's speed-up (another process: never a speed-up of its own).
Everything else the user passes goes to both runs, so the two reference arms are the same
request; ``--min-speedup`` goes to the head only (the base has no candidate to gate).

[Note: one worktree per review]
Both refs are checked out, one after the other, in the same worktree (``<out>/worktree``
unless ``--worktree`` names another; the user's own checkout is never touched), switched in
place with ``git checkout``: DeepSpeed JIT-builds its ops into a directory keyed by the
source's path ([Note: ops of a checkout], qualify/run/subjects.py), and rebuilds them when
their sources' times change, so one path whose op sources a switch leaves alone builds them
once for both runs and -- with ``--worktree`` -- for every review and resume of the same
repository. The review's own worktree (``<out>/worktree``) is removed, with its
registration in the user's repository, however the review ends (a verdict, a refusal, a
crash, a signal); a resumed review adds it again where a run must run. A ``--worktree`` the
user named is theirs and kept (``git worktree remove`` removes it).

[Note: review resume]
The directory holds the request (``request.json``: the repository, both SHAs, the worktree
and the run options) and each run's record (``base/``, ``head/``). Started again with the
same request, a run whose record loads, verifies, holds the plan the run would build now
and names the same commit is reused, re-judged by today's rules (as ``matrix`` resumes a
cell: [Note: matrix resume], qualify/matrix/cells.py); every other run runs. A request
that differs (a ref now names another commit, other run options) is refused naming what
differs; ``--restart`` discards the earlier runs and starts over. SIGINT or SIGTERM stops
the running child ([Note: supervising a run], qualify/base/supervise.py), keeps every finished
record and exits 128 + the signal.
"""
