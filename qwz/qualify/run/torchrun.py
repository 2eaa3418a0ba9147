"""A run torchrun started: this process is one of its ranks ([Note: a crash under torchrun]).

``run(request, write_failure)``: this rank's part, every rank's observations on rank 0;
`write_failure` writes the run's files of a failure (qualify/review/run_files.py, handed in
by the CLI: this layer writes no report).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import signal
from collections.abc import Callable

from qwz.qualify.base import rank_reports
from qwz.qualify.run.launch import RankFailure, torchrun_failure


def run(request, write_failure: Callable[[RankFailure], object]):
    """This rank's part of a run torchrun started; rank 0 gets every rank's observations.

    [Note: a crash under torchrun]
    A rank's own failure ends it through qwz.qualify.base.rank_reports.crash, as with local ranks
    ([Note: failures], qualify/run/runner.py), and torchrun's agent then stops the others;
    no process outlives the ranks to read their reports, as a local launcher does. So the
    rank that fails first to claim the run's record writes it, from crash()'s hook, before it
    exits: it waits up to launch.GRACE_S for every rank's report, picks the rank that failed
    first ([Note: the rank that failed first]) and writes the FAIL record a local run
    would (keeping the arms every rank finished), ignoring torchrun's SIGTERM meanwhile. The
    reports go to ``<out>/rank-reports/<run>`` (one directory per torchrun run and restart,
    so a run never reads an earlier one's); across nodes the writer sees every rank's
    reports only where ``--out`` is a shared directory, and ranks it cannot see are
    "unreported". A rank killed by a signal is named when a peer's collective fails (on
    gloo at once; on NCCL when the aborted collective raises); a run whose ranks all hang
    or die leaves only their reports (torchrun's agent has their exit statuses)."""
    import torch.distributed as dist

    from qwz.qualify.run.runner import qualify_rank

    plan, world_size, out = request.plan, request.world_size, request.out
    running = f"{qualify_rank.__module__}.{qualify_rank.__qualname__}"
    reports = _reports(out)

    def write_record() -> None:  # crash()'s hook on a rank with peers
        if rank_reports.claim("record"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_failure(torchrun_failure(reports, world_size, running))

    _init_group(request.launch.timeout)
    rank_reports.on_crash(write_record)
    try:
        observations = qualify_rank(plan)
    except Exception as error:  # with one rank, crash() re-raised it; or raised before it
        if rank_reports.reported_failure(reports, dist.get_rank()) is None:
            with contextlib.suppress(Exception):
                rank_reports.crash(error, phase="start")  # with peers it exits here
        raise torchrun_failure(reports, world_size, running, grace_s=0) from error
    finally:
        rank_reports.on_crash(None)
        dist.destroy_process_group()
    rank_reports.forget()  # this rank finished: its reports are moot
    with contextlib.suppress(OSError):
        (out / "rank-reports").rmdir()
    return observations


def _reports(out: pathlib.Path) -> pathlib.Path:
    """This torchrun run's reports directory ([Note: a crash under torchrun]), set for the
    side channel (qwz.qualify.base.rank_reports) unless ``QWZ_RANK_REPORTS`` names one."""
    if rank_reports.REPORTS_ENV not in os.environ:
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "run")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        reports = out / "rank-reports" / f"{run}-{restart}"
        reports.mkdir(parents=True, exist_ok=True)
        os.environ[rank_reports.REPORTS_ENV] = str(reports)
    return pathlib.Path(os.environ[rank_reports.REPORTS_ENV])


def _init_group(timeout_s: float) -> None:
    """The default process group torchrun's environment describes: NCCL on this rank's GPU
    (LOCAL_RANK) where there is one, else gloo."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
