"""Run a matrix: every cell as ``python -m qwz.qualify run <args> --out DIR/cells/<id>``.

[Note: matrix resume]
  A cell is finished when ``DIR/cells/<id>/record.json`` loads and verifies
  (``record.load``: schema, digest, checks re-derived, signature) and its plan and world
  size are the ones the cell asks for now: the plan ``run`` would build from the cell's
  arguments (``expected_plan``: this build's parser and ``run_request.resolve``, the same
  code ``run`` uses). A finished cell is never run again, whatever its verdict; every other
  cell -- no record, a record that does not load, a record of another plan (the spec or
  the code changed), a refusal, a crash -- runs (with ``--force`` over a stale record).
  So a matrix that was killed, or stopped by SIGINT/SIGTERM, continues where it was when
  started again with the same ``--out``.

Signals: each cell's ``run`` is started in its own session, so a Ctrl-C reaches the matrix alone;
the matrix forwards SIGINT or SIGTERM to the running cell once (``run`` then stops its
ranks and writes no record, only ``interrupted.json``), waits for it (SIGKILL after
``supervise.STOP_GRACE_S``), marks the cells not reached as "not run", writes the table
and exits 128 + the signal number.
The child asks for SIGTERM when the matrix dies, so even a SIGKILLed matrix leaves no cell
running ([Note: supervising a run], qualify/base/supervise.py).

How a cell's end reads: exit 0, 1 or 3 with a record that loads is its verdict (the
record's own); exit 4 with ``harness-error.json`` is "HARNESS-ERROR" with what the harness
needed (run again on the next start, like any cell without a record); exit 3 with
``timed-out.json`` is INCONCLUSIVE without a record, naming the cell's ``--timeout``
([Note: unfinished runs], run again on the next start); exit 2 is "not run"
with ``run``'s refusal (its ``error:`` lines on stderr);
130/143 while the matrix was being stopped is "not run" (interrupted); anything else, or a
verdict exit without a loadable record of the cell's plan, is "crashed" with why.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from qwz.qualify.base import exit_codes, supervise
from qwz.qualify.base.plan import plan_dict
from qwz.qualify.base.supervise import Stop
from qwz.qualify.evidence import harness_error, unfinished
from qwz.qualify.evidence.record import load as load_record
from qwz.qualify.evidence.rejudge import rejudged, verdict_text
from qwz.qualify.evidence.schema import Record, RecordError
from qwz.qualify.matrix.matrix_spec import Cell, Declared, Spec
from qwz.qualify.request import run_request
from qwz.qualify.request.run_request import RunRequest
from qwz.qualify.review import matrix as table
from qwz.qualify.review.matrix import MatrixCell

"""Seconds a stopped cell's ``run`` has to stop its ranks before it is killed."""
VERDICT_EXITS = {code: status for status, code in exit_codes.VERDICT_EXITS.items()}
REFUSED_EXIT = exit_codes.REFUSED


@dataclasses.dataclass(frozen=True)
class CellLogs:
    stdout: pathlib.Path
    stderr: pathlib.Path


Launcher = Callable[[list[str], CellLogs, "Stop"], int]
"""Runs ``qwz-qualify <argv>`` with its output in the logs and returns its exit status
(the seam the unit tests replace to count launches)."""


def subprocess_launcher(argv: list[str], logs: CellLogs, stop: Stop) -> int:
    """``python -m qwz.qualify <argv>``, supervised ([Note: supervising a run],
    base/supervise.py)."""
    with logs.stdout.open("w") as stdout, logs.stderr.open("w") as stderr:
        command = [sys.executable, "-m", "qwz.qualify", *argv]
        return supervise.run(command, stop, stdout=stdout, stderr=stderr)


def expected_plan(parser: argparse.ArgumentParser, arguments: list[str]) -> dict | None:
    """The plan (as the record stores it) that ``run <arguments>`` would build here; None
    where this build's ``run`` refuses the arguments (then no record can be this cell's)."""
    request = expected_request(parser, arguments, pathlib.Path(os.devnull))
    return None if request is None else recorded_plan(request)


def recorded_plan(request: RunRequest) -> dict:
    """The plan of `request` as its record stores it."""
    data = plan_dict(request.plan) | {"min_speedup": request.launch.min_speedup}
    return json.loads(json.dumps(data))


def expected_request(
    parser: argparse.ArgumentParser, arguments: list[str], out: pathlib.Path
) -> RunRequest | None:
    """The request ``run <arguments> --out OUT`` resolves to here ([Note: a request resolved
    once]); None where this build's ``run`` refuses the arguments."""
    refusals = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusals):
            namespace = parser.parse_args(["run", *arguments, "--out", str(out)])
        return run_request.resolve(namespace)
    except (SystemExit, ValueError):
        return None


def finished_record(cell_dir: pathlib.Path, plan: dict | None, world_size: int):
    """(the cell's finished record or None, why it is not finished) ([Note: matrix resume])."""
    path = cell_dir / "record.json"
    if not path.is_file():
        return None, "no record"
    try:
        record = load_record(path)
    except RecordError as error:
        return None, f"its record does not load: {error}"
    if plan is None:
        return None, "this build's run refuses the cell's arguments"
    stored = record.plan.model_dump(mode="json")
    # A key the record's plan lacks is a setting its harness did not have yet: what it ran
    # is what that setting's default means now (the record schema's rule for new fields).
    keys = sorted(
        key for key in set(stored) | set(plan) if key in stored and stored[key] != plan.get(key)
    )
    if keys:
        return None, f"its record has another plan (differs in {', '.join(keys)})"
    if record.environment.world_size != world_size:
        return None, f"its record ran {record.environment.world_size} ranks, not {world_size}"
    return record, ""


def refusal_reason(stderr_text: str) -> str:
    """``run``'s refusal, from its stderr: the ``error:`` lines, or its last line."""
    lines = [line.strip() for line in stderr_text.splitlines() if line.strip()]
    errors = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
    found = errors or lines[-1:] or ["no reason given on stderr"]
    return "refused by run: " + "; ".join(found)


def _verdict_reason(record: Record) -> str:
    """The failed (else inconclusive) checks of a record under today's rules with their
    details, after any judge change that moved its verdict; "" for a PASS."""
    judged = rejudged(record)
    names = judged.verdict.failed or judged.verdict.inconclusive
    details = [f"{check.name}: {check.detail}" for check in judged.checks if check.name in names]
    if judged.verdict.status != record.verdict.status:
        details.insert(0, f"re-judged: {verdict_text(record)}")
    text = "; ".join(details)
    return text if len(text) <= 400 else text[:397] + "..."


def _row(cell: Cell, arguments: list[str], **fields: Any) -> MatrixCell:
    record: Record | None = fields.pop("record", None)
    axes = {axis: list(value) if isinstance(value, tuple) else value for axis, value in cell.axes}
    return MatrixCell(
        id=cell.id,
        group=cell.group,
        axes=axes,
        arguments=arguments,
        record=None if record is None else f"cells/{cell.id}/record.json",
        digest=None if record is None else record.digest,
        wall_s=fields.pop("wall_s", None),
        **fields,
    )


def _declared_row(row: Declared) -> MatrixCell:
    return MatrixCell(
        id=row.id,
        group=None,
        axes={axis: list(value) if isinstance(value, tuple) else value for axis, value in row.axes},
        status="not run",
        kind=row.kind,
        reason=row.reason,
        arguments=[],
        record=None,
        digest=None,
        wall_s=None,
    )


class _Launched(NamedTuple):
    """What a launched cell's end is read against."""

    cell_dir: pathlib.Path
    plan: dict | None
    world_size: int
    logs: CellLogs
    wall_s: float


def _ended(cell: Cell, arguments: list[str], code: int, run: _Launched, stop: Stop) -> MatrixCell:
    """The row of a cell whose ``run`` ended with `code` (module docstring)."""
    wall_s, logs = run.wall_s, run.logs
    stderr = logs.stderr.read_text(errors="replace") if logs.stderr.is_file() else ""
    if code == REFUSED_EXIT:
        reason = refusal_reason(stderr)
        return _row(cell, arguments, status="not run", kind="refused", reason=reason)
    # Stopped: run's own exit on the signal, or the SIGKILL after supervise.STOP_GRACE_S.
    if stop.signum is not None and code in (128 + stop.signum, -stop.signum, -signal.SIGKILL):
        name = signal.Signals(stop.signum).name
        reason = f"the matrix was stopped by {name} while this cell ran; its run wrote no record"
        return _row(cell, arguments, status="not run", kind="interrupted", reason=reason)
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if code in harness_error.UNJUDGED_EXITS:
        verdict = harness_error.UNJUDGED_EXITS[code]
        said = harness_error.read_summary(run.cell_dir)
        if said is not None:  # [Note: harness errors]: the subject was not judged
            return _row(
                cell,
                arguments,
                status=verdict,
                kind=verdict.lower(),
                reason=said,
                wall_s=wall_s,
            )
        reason = f"run exited {code} ({verdict}) but wrote no readable "
        reason += harness_error.FILE_NAME
    elif code == exit_codes.INCONCLUSIVE and (timed_out := _timed_out(run.cell_dir)):
        return _row(
            cell, arguments, status="INCONCLUSIVE", kind="ran", reason=timed_out, wall_s=wall_s
        )
    elif code in VERDICT_EXITS:
        record, why = finished_record(run.cell_dir, run.plan, run.world_size)
        if record is None:
            reason = f"run exited {code} ({VERDICT_EXITS[code]}) but {why}"
        elif record.verdict.status != VERDICT_EXITS[code]:
            reason = f"run exited {code} but its record says {record.verdict.status}"
        else:
            return _row(
                cell,
                arguments,
                status=record.verdict.status,
                kind="ran",
                reason=_verdict_reason(record),
                record=record,
                wall_s=wall_s,
            )
    elif code < 0:
        reason = f"run was killed by {signal.Signals(-code).name}"
    else:
        reason = f"run exited {code}, which run never gives for a finished run"
    reason += f" (last stderr line: {last.strip()})" if last else ""
    return _row(cell, arguments, status="crashed", kind="crashed", reason=reason, wall_s=wall_s)


def _timed_out(cell_dir: pathlib.Path) -> str | None:
    """The TIMED-OUT line of the cell's ``timed-out.json``, None without one."""
    if not (cell_dir / unfinished.TIMED_OUT_FILE).is_file():
        return None
    return unfinished.read_summary(cell_dir)


@dataclasses.dataclass(frozen=True)
class MatrixRun:
    """A spec to run into `out` ([Note: matrix resume]), with what every cell adds."""

    spec: Spec
    out: pathlib.Path
    parser: argparse.ArgumentParser
    extra_arguments: tuple[str, ...] = ()
    """Arguments every cell's ``run`` gets after its own (``--ledger DIR``, ...)."""
    launch: Launcher = subprocess_launcher


def run_cell(matrix: MatrixRun, cell: Cell, stop: Stop, previous: MatrixCell | None) -> MatrixCell:
    """Run one cell, or keep its finished record ([Note: matrix resume])."""
    arguments = [*cell.run_arguments(), *matrix.extra_arguments]
    cell_dir = matrix.out / "cells" / cell.id
    plan = expected_plan(matrix.parser, arguments)
    world = cell.value("world_size")
    record, _ = finished_record(cell_dir, plan, world)
    if record is not None:
        same = previous is not None and previous.digest == record.digest
        return _row(  # re-judged by today's rules, never re-run for a judge change
            cell,
            arguments,
            status=rejudged(record).verdict.status,
            kind="resumed",
            reason=_verdict_reason(record),
            record=record,
            wall_s=previous.wall_s if same else None,
        )
    logs_dir = matrix.out / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    cell_dir.parent.mkdir(parents=True, exist_ok=True)
    logs = CellLogs(logs_dir / f"{cell.id}.out", logs_dir / f"{cell.id}.err")
    argv = ["run", *arguments, "--out", str(cell_dir), "--force"]
    started = time.monotonic()
    code = matrix.launch(argv, logs, stop)
    launched = _Launched(cell_dir, plan, world, logs, time.monotonic() - started)
    return _ended(cell, arguments, code, launched, stop)


def _table(matrix: MatrixRun, rows: dict[str, MatrixCell], stop: Stop, times) -> table.Matrix:
    """The table now: every cell (those not reached yet pending or interrupted), then the
    declared rows."""
    cells = []
    for cell in matrix.spec.cells:
        if cell.id in rows:
            cells.append(rows[cell.id])
            continue
        arguments = [*cell.run_arguments(), *matrix.extra_arguments]
        if stop.signum is None:
            cells.append(
                _row(
                    cell,
                    arguments,
                    status="not run",
                    kind="pending",
                    reason="not reached yet (the matrix is running, or was killed)",
                )
            )
        else:
            reason = f"not reached: the matrix was stopped by {signal.Signals(stop.signum).name}"
            cells.append(_row(cell, arguments, status="not run", kind="interrupted", reason=reason))
    cells += [_declared_row(row) for row in matrix.spec.declared]
    return table.Matrix(
        name=matrix.spec.name,
        description=matrix.spec.description,
        spec=str(matrix.spec.path),
        created_at=times[0],
        wall_s=round(time.monotonic() - times[1], 3),
        cells=cells,
    )


def _previous(out: pathlib.Path) -> dict[str, MatrixCell]:
    """The rows of the table an earlier run left in `out` (for resumed cells' wall times)."""
    try:
        return {cell.id: cell for cell in table.load_matrix(out).cells}
    except RecordError:
        return {}


def run_matrix(matrix: MatrixRun, progress: Callable[[str], None]) -> int:
    """Every cell in spec order; the table after each; the matrix's exit status
    (qualify/review/matrix.py's ``status_of``, or 128 + the signal that stopped it)."""
    times = (datetime.datetime.now(datetime.timezone.utc).isoformat(), time.monotonic())
    matrix.out.mkdir(parents=True, exist_ok=True)
    previous = _previous(matrix.out)
    rows: dict[str, MatrixCell] = {}
    stop = Stop()
    with stop.installed():
        for number, cell in enumerate(matrix.spec.cells, start=1):
            if stop.signum is not None:
                break
            row = run_cell(matrix, cell, stop, previous.get(cell.id))
            rows[cell.id] = row
            wall = (
                f" in {row.wall_s:.1f} s"
                if row.wall_s is not None and row.kind != "resumed"
                else ""
            )
            why = f": {row.reason}" if row.reason else ""
            progress(
                f"{number}/{len(matrix.spec.cells)} {cell.id}: {row.status} ({row.kind}{wall}){why}"
            )
            table.write(matrix.out, _table(matrix, rows, stop, times))
    written = _table(matrix, rows, stop, times)
    table.write(matrix.out, written)
    if stop.signum is not None:
        return 128 + stop.signum
    return table.status_of(written.cells)
