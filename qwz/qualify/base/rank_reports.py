"""The side channel between ranks and their launcher: files, no collective.

A rank that fails while its peers may sit inside a collective cannot tell them
with a collective (they would never answer), and a rank that is killed cannot
tell anyone anything. So every rank keeps a few small files in a directory the
launcher names in ``QWZ_RANK_REPORTS`` (``qwz.qualify.run.launch.LocalWorld`` makes one per
world; ``qwz-qualify run`` under torchrun uses ``<out>/rank-reports/<run>``)::

    rank00001.where.json     where the rank is: report_progress(arm=..., step=...)
    rank00001.failure.json   why it stopped: written by crash(), then the process exits
    rank00001.result.<key>.pkl  a finished piece of work: report_result(key, value)

Each file is written whole or not at all (a temporary file, then ``os.replace``),
so the launcher reads either the previous version or the new one, never half.
Without ``QWZ_RANK_REPORTS`` every writer is a no-op and :func:`crash` still
aborts the process group.

[Note: the rank that failed first]
When one rank fails, its peers fail too, as a consequence: on gloo their next
collective raises "Connection reset/closed by peer", on NCCL they hang until
the launcher stops them. The cause is chosen in this order: the earliest
failure report that is not a lost-peer error (a rank writes its report before
it aborts the group, so its report precedes every error it causes); else a
rank that died without a report (SIGKILL, an exit code), earliest seen first;
else the earliest report. Everything else is context, never the cause. Under torchrun, where
no launcher sees the ranks' exits, a rank without a report when the record is written is
"unreported" (killed, or still inside a collective) and ranks with the dead ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pickle
import re
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import torch.distributed as dist

REPORTS_ENV = "QWZ_RANK_REPORTS"
CRASH_EXIT_CODE = 70
"""Exit status of a rank that stopped through :func:`crash` (EX_SOFTWARE)."""
ABORT_WAIT_S = 5.0
"""How long :func:`crash` lets the process-group abort take before exiting anyway."""
TRACEBACK_LINES = 40
"""Lines of a failing rank's traceback kept in its report (the innermost ones)."""
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_PEER_LOST = re.compile(
    r"reset by peer|closed by peer|broken pipe|remote worker crash|connection refused|"
    r"communicator was aborted|NCCL communicator|socket timeout|failed to recv|"
    r"failed to send|DistNetworkError|DistBackendError",
    re.IGNORECASE,
)


class RankEnd(NamedTuple):
    """How one rank stopped, as its launcher saw it (see [Note: the rank that failed first])."""

    rank: int
    how: str
    """"raised" (its exception is known), "signal", "exit" (died without a report),
    "timeout" (still running when the launcher's time ran out) or "unreported" (under
    torchrun, where no launcher sees the ranks: no report when the record was written)."""
    error: str | None
    """``Type: message`` of the exception (its first line), or a description of the death."""
    traceback: tuple[str, ...]
    signal: str | None
    exit_code: int | None
    where: dict[str, Any]
    """The rank's last report_progress fields (and the failure's, when it reported one)."""
    at_s: float
    """Wall-clock time of its report, or when the launcher saw it dead."""

    @property
    def peer_lost(self) -> bool:
        """A collective error caused by another rank's failure, not a failure of its own."""
        return self.how == "raised" and bool(_PEER_LOST.search(self.error or ""))

    def describe(self) -> str:
        if self.how == "signal":
            return f"was killed by {self.signal}"
        if self.how == "exit":
            return f"died with exit code {self.exit_code}"
        if self.how == "timeout":
            return "did not finish (still running: a hang, or a run longer than the limit)"
        if self.how == "unreported":
            return "ended without a report (killed, or still inside a collective)"
        return f"raised {self.error}"


def first_failure(ends: list[RankEnd]) -> RankEnd:
    """The cause among `ends` (non-empty), by [Note: the rank that failed first]."""
    order = [
        [end for end in ends if end.how == "raised" and not end.peer_lost],
        [end for end in ends if end.how in ("signal", "exit", "unreported")],
        list(ends),
    ]
    candidates = next(group for group in order if group)
    return min(candidates, key=lambda end: (end.at_s, end.rank))


# ------------------------------------------------------------------- rank side


def _directory() -> pathlib.Path | None:
    text = os.environ.get(REPORTS_ENV)
    return pathlib.Path(text) if text else None


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _write(path: pathlib.Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def report_progress(**where: Any) -> None:
    """Replace this rank's where-file with `where` (JSON data: the arm, the step, ...)."""
    directory = _directory()
    if directory is not None:
        name = f"rank{_rank():05d}.where.json"
        _write(directory / name, json.dumps(where, sort_keys=True).encode())


def report_result(key: str, value: Any) -> None:
    """Keep `value` (picklable) under `key`, so a launcher whose run later fails still has it."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"report_result: key {key!r} must match {_KEY.pattern}")
    directory = _directory()
    if directory is not None:
        _write(directory / f"rank{_rank():05d}.result.{key}.pkl", pickle.dumps(value))


_crash_hook: Callable[[], None] | None = None


def on_crash(hook: Callable[[], None] | None) -> None:
    """Have :func:`crash` call `hook` after this rank's report is written and its process
    group aborted, before the process exits (None: no hook). Under torchrun no launcher
    outlives the ranks, so the CLI's hook writes the run's record from here ([Note: a crash
    under torchrun], qualify/run/torchrun.py)."""
    global _crash_hook
    _crash_hook = hook


def claim(name: str) -> bool:
    """True for the first caller on any rank to claim `name` in the reports directory (an
    exclusive create), False for every later one, and without a directory."""
    directory = _directory()
    if directory is None:
        return False
    try:
        os.close(os.open(directory / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def crash(error: BaseException, **where: Any) -> NoReturn:
    """This rank cannot go on: report `error` and `where` to the launcher, then, with peers,
    abort the process group, run the :func:`on_crash` hook and exit with CRASH_EXIT_CODE --
    never wait for the peers, who may be inside a collective this rank will not enter. With
    no peers, re-raise `error`."""
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    text = "".join(lines)
    print(f"rank {_rank()}: {text}", file=sys.stderr, flush=True)
    directory = _directory()
    if directory is not None:
        report = {
            "error": f"{type(error).__name__}: {error}".splitlines()[0][:2000],
            "traceback": text.splitlines()[-TRACEBACK_LINES:],
            "where": where,
            "at_s": time.time(),
        }
        with contextlib.suppress(OSError):
            _write(directory / f"rank{_rank():05d}.failure.json", json.dumps(report).encode())
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise error
    _abort_process_group()
    if _crash_hook is not None:
        try:
            _crash_hook()
        except BaseException:  # the exit below must happen whatever the hook does
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)


def forget() -> None:
    """Remove this rank's files (its run finished), and the directory once it is empty."""
    directory = _directory()
    if directory is None:
        return
    for path in directory.glob(f"rank{_rank():05d}.*"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def _abort_process_group() -> None:
    """Abort the default group (peers' collectives fail instead of waiting, where the backend
    supports it), giving up after ABORT_WAIT_S: the exit that follows closes it anyway."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            abort()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(ABORT_WAIT_S)


# --------------------------------------------------------------- launcher side


def clear(directory: pathlib.Path) -> None:
    """Remove every report, before a new call into the ranks."""
    for path in directory.iterdir():
        with contextlib.suppress(OSError):
            path.unlink()


def any_failure(directory: pathlib.Path) -> bool:
    return any(directory.glob("rank*.failure.json"))


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def where(directory: pathlib.Path, rank: int) -> dict[str, Any]:
    return _read_json(directory / f"rank{rank:05d}.where.json")


def reported_failure(directory: pathlib.Path, rank: int) -> RankEnd | None:
    report = _read_json(directory / f"rank{rank:05d}.failure.json")
    if not report:
        return None
    return RankEnd(
        rank=rank,
        how="raised",
        error=str(report.get("error")),
        traceback=tuple(str(line) for line in report.get("traceback", [])),
        signal=None,
        exit_code=None,
        where=where(directory, rank) | dict(report.get("where") or {}),
        at_s=float(report.get("at_s", time.time())),
    )


def unreported(directory: pathlib.Path, rank: int) -> RankEnd:
    """How `rank` ended as far as the side channel alone tells (no failure report): where it
    last said it was, no more."""
    return RankEnd(rank, "unreported", None, (), None, None, where(directory, rank), time.time())


def result_keys(directory: pathlib.Path, world_size: int) -> dict[int, list[str]]:
    """Every rank's report_result keys, sorted, without reading the values."""
    found: dict[int, list[str]] = {rank: [] for rank in range(world_size)}
    for path in sorted(directory.glob("rank*.result.*.pkl")):
        rank_text, _, key = path.name.removesuffix(".pkl").partition(".result.")
        with contextlib.suppress(ValueError):
            found.setdefault(int(rank_text.removeprefix("rank")), []).append(key)
    return found


def results(directory: pathlib.Path, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's report_result values: {rank: {key: value}}."""
    found: dict[int, dict[str, Any]] = {rank: {} for rank in range(world_size)}
    for path in directory.glob("rank*.result.*.pkl"):
        rank_text, _, key = path.name.removesuffix(".pkl").partition(".result.")
        with contextlib.suppress(OSError, ValueError, pickle.UnpicklingError, EOFError):
            found.setdefault(int(rank_text.removeprefix("rank")), {})[key] = pickle.loads(
                path.read_bytes()
            )
    return found
