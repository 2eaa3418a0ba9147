"""Local process groups: spawn ranks on this machine, run functions on all of them, and
report the failing rank's traceback instead of hanging.

Used by the multigpu tests and by ``qwz-qualify run`` when it is not started by
torchrun. A :class:`LocalWorld` keeps its ranks alive between calls so that a
test session pays process start-up and rendezvous once per world size::

    with LocalWorld(world_size=2) as world:
        results = world.run(train_fn, config)   # one result per rank

``train_fn`` must be importable (a module-level function); it runs on every rank
with the default process group initialised (NCCL when there are enough GPUs,
gloo otherwise; ``QWZ_BACKEND`` overrides) and the usual torchrun environment
variables set, so DeepSpeed finds its process group too.

When a rank fails -- returns an exception, reports one through ``qwz.qualify.base.rank_reports``
(a rank that stops with ``rank_reports.crash`` while its peers sit in a collective),
dies, or outlasts the timeout -- ``run`` gives the others GRACE_S to fail too, kills
what still runs and raises :class:`RankFailure` naming the rank that failed first
([Note: the rank that failed first] in qwz/qualify/base/rank_reports.py), with the others' ends as
context and what the ranks had kept with ``rank_reports.report_result``.

[Note: no orphaned ranks]
  Each rank leads its own process group (so a compile worker it starts is
  killed with it) and, on Linux, asks the kernel for SIGKILL when its parent
  dies, so even a SIGKILLed parent leaves no rank behind. Ranks ignore SIGINT:
  a Ctrl-C reaches the whole terminal process group, and the parent alone
  decides. While ``launch`` runs, SIGINT and SIGTERM in the parent raise
  :class:`Interrupted`; leaving the ``LocalWorld`` with any exception kills every
  rank's process group and reaps it, well within 10 s, and the CLI exits with
  128 + the signal number (130, 143), as a shell would.

[Note: forked ranks]
  A spawned rank is a fresh interpreter: it imports torch, ``torch._dynamo`` (which
  ``torch.optim`` pulls in) and, for a DeepSpeed subject, DeepSpeed, 3 to 4 s of CPU before
  its first step; a short qualification's ranks spent more on that than on training. A world
  given ``preload`` (``launch`` from ``qwz-qualify run``) imports those modules once in the
  launcher and forks its gloo ranks from it where [Note: forking is sound]
  (run/forking.py). The store that the ranks meet at is made after the fork, so no store
  thread is copied, and its port reaches each rank as its first task. A forked rank starts
  from the launcher's imports, ``sys.path`` and environment, which are the ones a spawned
  rank would rebuild; it then sets, as a spawned rank does, one intra-op thread, its own
  process group and default signal dispositions, so the launcher's SIGTERM handler is not
  inherited. Anywhere else, and for every world made without
  ``preload`` (the test suite's warm worlds), ranks are spawned as before. Side by side, a
  qualification's hashes and losses are the same either way; a forked rank's peak RSS (context
  on a CPU, never judged) was about 15% lower, as it shares the launcher's pages.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pathlib
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwz.devices import use_cpu_accelerator_for_gloo
from qwz.qualify.base import rank_reports
from qwz.qualify.base.rank_reports import RankEnd
from qwz.qualify.run import forking

BACKEND_ENV = "QWZ_BACKEND"
DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 5.0
"""After the first failure, how long the other ranks get to fail too (their errors are
context) or finish, before every rank still running is killed."""
POLL_S = 0.2


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback or exit code.

    ``cause`` is the rank that failed first ([Note: the rank that failed first] in
    qwz/qualify/base/rank_reports.py), ``context`` how the other failed ranks ended,
    ``results`` what every rank had kept with ``rank_reports.report_result`` before the failure."""

    def __init__(
        self,
        message: str,
        cause: RankEnd | None = None,
        context: tuple[RankEnd, ...] = (),
        results: dict[int, dict[str, Any]] | None = None,
    ):
        super().__init__(message)
        self.cause = cause
        self.context = context
        self.results = results or {}
        self.limit_s: float | None = None
        """The time limit that ran out, where that is how the ranks ended (else None)."""


class Interrupted(BaseException):  # like KeyboardInterrupt: not caught by `except Exception`
    """SIGINT or SIGTERM reached the parent while ranks ran; every rank has been stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        self.ranks: RanksSoFar | None = None
        """How far the ranks had got, where a LocalWorld was running them."""
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class RanksSoFar(NamedTuple):
    """What the ranks had done when they were stopped (their side-channel reports)."""

    finished: dict[int, list[str]]
    """Per rank, the keys of its report_result values (qualify's runner: the arms it finished)."""
    where: dict[int, dict[str, Any]]
    """Per rank, where it last said it was (report_progress)."""


@contextlib.contextmanager
def signals_interrupt():
    """While inside, SIGINT and SIGTERM raise :class:`Interrupted` in the main thread
    (see [Note: no orphaned ranks]); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _detach_from_parent_signals() -> None:
    """In a rank: own process group, SIGINT ignored, SIGTERM default, SIGKILL when the
    parent dies."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked rank has the launcher's handler
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
            if os.getppid() == 1:  # the parent died before prctl took effect
                os._exit(1)


def pick_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, gloo otherwise; `QWZ_BACKEND` overrides."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def start_method(backend: str, preload: Sequence[str] | None) -> str:
    """How to start ranks: ``fork`` where [Note: forked ranks] allows it and the caller asked
    for it (`preload` not None), else ``spawn``."""
    if preload is None or backend != "gloo" or not forking.sound():
        return "spawn"
    return "fork"


def import_for_fork(backend: str, preload: Sequence[str] | None) -> str:
    """Import `preload` here where ranks on `backend` will be forked from this process
    ([Note: forked ranks]); how they will be started. A caller that forks other children
    first (the CLI's conformance table) calls it early, so those start from the imports too."""
    if start_method(backend, preload) == "fork":
        for name in preload or ():
            importlib.import_module(name)
    return start_method(backend, preload)  # an import may have started a thread


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    collective_timeout_s: float,
    reports_dir: str,
    tasks: Any,
    results: Any,
) -> None:
    _detach_from_parent_signals()
    port = tasks.get()  # the launcher makes the store after starting its ranks
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ[rank_reports.REPORTS_ENV] = reports_dir
    torch.set_num_threads(1)
    use_cpu_accelerator_for_gloo(backend)  # [Note: collectives on the group's device]
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class LocalWorld:
    """`world_size` ranks with an initialised process group, reused across calls.

    This class is longer than 150 lines because one launcher owns the local ranks' whole
    life: their start, the side channel, the first failure and the stop."""

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        preload: Sequence[str] | None = None,
    ):
        """`preload`: modules the ranks will import, imported here once so that the ranks
        can be forked from this process ([Note: forked ranks]); None spawns them."""
        self.world_size = world_size
        self.backend = backend or pick_backend(world_size)
        self.timeout_s = timeout_s
        self.start_method = import_for_fork(self.backend, preload)
        context = mp.get_context(self.start_method)
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        # [Note: the rank that failed first]: the ranks' side channel to this launcher.
        self.reports_dir = pathlib.Path(tempfile.mkdtemp(prefix="qwz-rank-reports-"))
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    self.backend,
                    timeout_s,
                    str(self.reports_dir),
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        # The parent hosts the rendezvous store on a port the OS picks and keeps bound, so
        # no other process can take the port between choosing it and using it.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        for task_queue in self._tasks:
            task_queue.put(self._store.port)
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Raises RankFailure naming the rank that failed first: one that raised (returned an
        error or reported one through qwz.qualify.base.rank_reports), died or outlasted the
        timeout. The others get GRACE_S to finish or fail; a world with a dead or unfinished rank is
        broken (every rank is killed)."""
        if self.broken:
            raise RankFailure("this LocalWorld is broken by an earlier failure; start a new one")
        rank_reports.clear(self.reports_dir)
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        try:
            return self._wait(fn)
        except Interrupted as interrupted:  # read before leaving the world removes the reports
            interrupted.ranks = RanksSoFar(
                rank_reports.result_keys(self.reports_dir, self.world_size),
                {
                    rank: rank_reports.where(self.reports_dir, rank)
                    for rank in range(self.world_size)
                },
            )
            raise

    def _wait(self, fn: Callable[..., Any]) -> list[Any]:
        """The results of `fn` on every rank, or the RankFailure (see ``run``)."""
        outcomes: dict[int, tuple[bool, Any, float]] = {}
        died_at: dict[int, float] = {}
        deadline = time.monotonic() + self.timeout_s
        while not self._failed(outcomes, died_at):
            if len(outcomes) == self.world_size:
                return [outcomes[rank][1] for rank in range(self.world_size)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                ends = [self._timed_out(rank) for rank in missing]
                failure = self._failure(fn, ends, outcomes, f" within {self.timeout_s:g} s")
                failure.limit_s = self.timeout_s
                self.close(kill=True)
                raise failure
            self._poll(outcomes, died_at, POLL_S)
        grace_end = time.monotonic() + GRACE_S
        while len(outcomes) + len(died_at) < self.world_size and time.monotonic() < grace_end:
            self._poll(outcomes, died_at, POLL_S)
        ends = [self._end(rank, outcomes, died_at) for rank in range(self.world_size)]
        failure = self._failure(fn, [end for end in ends if end is not None], outcomes, "")
        if died_at or len(outcomes) < self.world_size:
            self.close(kill=True)  # the reports are read: the directory may go
        raise failure

    def _failed(self, outcomes: dict[int, tuple], died_at: dict[int, float]) -> bool:
        return (
            bool(died_at)
            or any(not ok for ok, _, _ in outcomes.values())
            or rank_reports.any_failure(self.reports_dir)
        )

    def _poll(
        self, outcomes: dict[int, tuple[bool, Any, float]], died_at: dict[int, float], wait_s: float
    ) -> None:
        """Take one result (waiting up to `wait_s`), then note every rank newly dead."""
        try:
            rank, ok, value = self._results.get(timeout=wait_s)
            outcomes[rank] = (ok, value, time.time())
        except queue.Empty:
            pass
        for rank, process in enumerate(self._processes):
            if rank not in outcomes and rank not in died_at and not process.is_alive():
                died_at[rank] = time.time()

    def _end(
        self, rank: int, outcomes: dict[int, tuple[bool, Any, float]], died_at: dict[int, float]
    ) -> RankEnd | None:
        """How `rank` ended, or None when it returned a result."""
        reported = rank_reports.reported_failure(self.reports_dir, rank)
        if reported is not None:
            return reported
        where = rank_reports.where(self.reports_dir, rank)
        if rank in outcomes:
            ok, value, at_s = outcomes[rank]
            if ok:
                return None
            lines = [line for line in str(value).splitlines() if line.strip()]
            error = lines[-1].strip() if lines else "an exception without a message"
            return RankEnd(rank, "raised", error, tuple(lines[-40:]), None, None, where, at_s)
        if rank in died_at:
            code = self._processes[rank].exitcode
            at_s = died_at[rank]
            if code is not None and code < 0:
                name = signal.Signals(-code).name
                return RankEnd(rank, "signal", f"killed by {name}", (), name, code, where, at_s)
            return RankEnd(rank, "exit", f"exit code {code}", (), None, code, where, at_s)
        return self._timed_out(rank)

    def _timed_out(self, rank: int) -> RankEnd:
        where = rank_reports.where(self.reports_dir, rank)
        return RankEnd(rank, "timeout", "still running", (), None, None, where, time.time())

    def _failure(
        self,
        fn: Callable[..., Any],
        ends: list[RankEnd],
        outcomes: dict[int, tuple[bool, Any, float]],
        within: str,
    ) -> RankFailure:
        raised = {rank: value for rank, (ok, value, _) in outcomes.items() if not ok}
        return rank_failure(ends, self.world_size, _name(fn), within, raised, self.reports_dir)

    def close(self, kill: bool = False) -> None:
        if not kill and not self.broken:
            for task_queue in self._tasks:
                with contextlib.suppress(Exception):
                    task_queue.put(None)
            for process in self._processes:
                process.join(timeout=30)
        for process in self._processes:
            if process.is_alive():
                _kill_rank(process)
        for process in self._processes:
            process.join(timeout=5)
        self.broken = True
        shutil.rmtree(self.reports_dir, ignore_errors=True)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving with an exception (Interrupted included) must not wait on busy ranks.
        self.close(kill=exc_type is not None)


def rank_failure(
    ends: list[RankEnd],
    world_size: int,
    running: str,
    within: str,
    raised: dict[int, str],
    reports_dir: pathlib.Path,
) -> RankFailure:
    """The RankFailure of ranks that ended as `ends` (those that did not return) while
    `running`: the rank that failed first ([Note: the rank that failed first]) and where,
    the others as context, `raised` the tracebacks known by rank, and every rank's
    report_result values from `reports_dir`."""
    cause = rank_reports.first_failure(ends)
    context = tuple(end for end in ends if end is not cause)
    where = ", ".join(f"{key} {value}" for key, value in sorted(cause.where.items()))
    others = "".join(f"; rank {end.rank} {end.describe()}" for end in context)
    message = (
        f"rank {cause.rank} of {world_size} {cause.describe()}{within} while running "
        f"{running}{f' ({where})' if where else ''}{others}"
    )
    if cause.how == "timeout":
        message += "; all ranks were killed"
    if cause.traceback and cause.rank not in raised:
        raised = {cause.rank: "\n".join(cause.traceback), **raised}
    texts = [f"\n--- rank {rank} ---\n{value}" for rank, value in raised.items()]
    results = rank_reports.results(reports_dir, world_size)
    return RankFailure(message + "".join(texts), cause, context, results)


def torchrun_failure(
    reports_dir: pathlib.Path, world_size: int, running: str, grace_s: float = GRACE_S
) -> RankFailure:
    """[Note: a crash under torchrun] (qualify/run/torchrun.py): the RankFailure a local launcher
    would raise, from the side channel alone, read by a rank that failed: every rank's
    failure report, waiting up to `grace_s` for all of them; a rank without one is
    "unreported" (no launcher sees its exit)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(rank_reports.reported_failure(reports_dir, r) for r in range(world_size)):
            break
        time.sleep(POLL_S)
    ends = [
        rank_reports.reported_failure(reports_dir, rank)
        or rank_reports.unreported(reports_dir, rank)
        for rank in range(world_size)
    ]
    return rank_failure(ends, world_size, running, "", {}, reports_dir)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Start `world_size` ranks (forked after importing `preload` where [Note: forked ranks]
    allows, else spawned), run `fn` once on each, return the per-rank results.

    SIGINT or SIGTERM meanwhile stops every rank and raises :class:`Interrupted`."""
    with (
        signals_interrupt(),
        LocalWorld(world_size, backend=backend, timeout_s=timeout_s, preload=preload) as world,
    ):
        return world.run(fn, *args, **kwargs)


def _kill_rank(process: Any) -> None:
    """SIGKILL a rank's whole process group (it leads one), or the rank alone if it does not
    lead one yet (killed before it reached ``_detach_from_parent_signals``)."""
    pid = process.pid
    if pid is None:
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        process.kill()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
