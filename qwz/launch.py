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

[Note: no orphaned ranks]
  Each rank leads its own process group (so a compile worker it starts is
  killed with it) and, on Linux, asks the kernel for SIGKILL when its parent
  dies, so even a SIGKILLed parent leaves no rank behind. Ranks ignore SIGINT:
  a Ctrl-C reaches the whole terminal process group, and the parent alone
  decides. While ``launch`` runs, SIGINT and SIGTERM in the parent raise
  :class:`Interrupted`; leaving the ``LocalWorld`` with any exception kills every
  rank's process group and reaps it, well within 10 s, and the CLI exits with
  128 + the signal number (130, 143), as a shell would.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwz.devices import use_cpu_accelerator_for_gloo

BACKEND_ENV = "QWZ_BACKEND"
DEFAULT_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback or exit code."""


class Interrupted(BaseException):  # like KeyboardInterrupt: not caught by `except Exception`
    """SIGINT or SIGTERM reached the parent while ranks ran; every rank has been stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


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
    """In a rank: own process group, SIGINT ignored, SIGKILL when the parent dies."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    collective_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    _detach_from_parent_signals()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
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
    """`world_size` spawned ranks with an initialised process group, reused across calls."""

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.world_size = world_size
        self.backend = backend or pick_backend(world_size)
        self.timeout_s = timeout_s
        context = mp.get_context("spawn")
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        # The parent hosts the rendezvous store on a port the OS picks and keeps bound, so
        # no other process can take the port between choosing it and using it.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        port = self._store.port
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    self.backend,
                    port,
                    timeout_s,
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Raises RankFailure with the first failing rank's traceback; a rank that dies or a
        call that outlasts the timeout breaks the world (every rank is killed)."""
        if self.broken:
            raise RankFailure("this LocalWorld is broken by an earlier failure; start a new one")
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                if not ok:
                    # The others may be blocked in a collective the failed rank never
                    # entered; give them a moment to fail too, then stop waiting.
                    self._collect_until(outcomes, seconds=5.0)
                    break
            except queue.Empty:
                dead = self._dead_ranks(outcomes)
                if dead:
                    self._collect_until(outcomes, seconds=5.0)
                    self.close(kill=True)
                    rank, code = dead[0]
                    raise RankFailure(
                        f"rank {rank} of {self.world_size} died with exit code {code} "
                        f"while running {_name(fn)}{_tracebacks(outcomes)}"
                    ) from None
                if datetime.datetime.now() > deadline:
                    self.close(kill=True)
                    missing = sorted(set(range(self.world_size)) - set(outcomes))
                    raise RankFailure(
                        f"ranks {missing} of {self.world_size} did not finish {_name(fn)} "
                        f"within {self.timeout_s:.0f} s (a hang or a deadlock); all ranks "
                        f"were killed{_tracebacks(outcomes)}"
                    ) from None
        failed = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
        if failed:
            dead = self._dead_ranks(outcomes)
            if len(outcomes) < self.world_size:
                self.close(kill=True)
            first = min(failed)
            died = "".join(f"; rank {r} died with exit code {c}" for r, c in dead)
            raise RankFailure(
                f"rank {first} of {self.world_size} raised in {_name(fn)} "
                f"(failed ranks: {sorted(failed)}{died}):\n{failed[first]}"
            )
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _dead_ranks(self, outcomes: dict[int, tuple[bool, Any]]) -> list[tuple[int, int | None]]:
        return [
            (rank, process.exitcode)
            for rank, process in enumerate(self._processes)
            if not process.is_alive() and rank not in outcomes
        ]

    def _collect_until(self, outcomes: dict[int, tuple[bool, Any]], seconds: float) -> None:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
        while len(outcomes) < self.world_size and datetime.datetime.now() < deadline:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                outcomes[rank] = (ok, value)
            except queue.Empty:
                continue

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

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving with an exception (Interrupted included) must not wait on busy ranks.
        self.close(kill=exc_type is not None)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Spawn `world_size` ranks, run `fn` once on each, return the per-rank results.

    SIGINT or SIGTERM meanwhile stops every rank and raises :class:`Interrupted`."""
    with signals_interrupt(), LocalWorld(world_size, backend=backend, timeout_s=timeout_s) as world:
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


def _tracebacks(outcomes: dict[int, tuple[bool, Any]]) -> str:
    texts = [f"\n--- rank {rank} ---\n{value}" for rank, (ok, value) in outcomes.items() if not ok]
    return "".join(texts)
