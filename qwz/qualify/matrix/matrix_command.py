"""``qwz-qualify matrix SPEC --out DIR``: the command (cli.py hands it the parsed arguments
and its parser, so this package never imports the CLI).

Exit status: 0 every cell that ran passed, 1 a cell FAILed or crashed, 3 INCONCLUSIVE cells
and no failure, or no cell with a verdict (qualify/review/matrix.py), 2 a refused request
(a spec that does not parse or validate, an unusable ``--out``), 130/143 stopped by
SIGINT/SIGTERM (the finished cells are kept; the same command continues).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from qwz.qualify.base.files import writable_directory_problem
from qwz.qualify.matrix import cells
from qwz.qualify.matrix.matrix_spec import SpecError, load


def extra_arguments(args: argparse.Namespace) -> list[str]:
    """The ``run`` arguments every cell gets from the matrix's own flags."""
    extra: list[str] = []
    if args.ledger is not None:
        extra += ["--ledger", str(args.ledger)]
    if args.min_speedup is not None:
        extra += ["--min-speedup", repr(args.min_speedup)]
    if args.deepspeed_src is not None:
        extra += ["--deepspeed-src", str(args.deepspeed_src)]
    return extra


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        spec = load(args.spec)
    except SpecError as error:
        print(f"qwz-qualify matrix: error: {error}", file=sys.stderr)
        return 2
    extra = extra_arguments(args)
    if args.list:
        for cell in spec.cells:
            print(f"{cell.id}: run {shlex.join([*cell.run_arguments(), *extra])}")
        for row in spec.declared:
            print(f"{row.id}: not run ({row.kind}): {row.reason}")
        return 0
    if args.out is None:
        print("qwz-qualify matrix: error: --out DIR is required (unless --list)", file=sys.stderr)
        return 2
    problem = writable_directory_problem(args.out, "--out")
    if problem:
        print(f"qwz-qualify matrix: error: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[qwz-qualify matrix {time.monotonic() - started:7.1f}s] {line}", file=sys.stderr)

    matrix = cells.MatrixRun(spec, args.out, parser, tuple(extra))
    progress(f"{spec.name}: {len(spec.cells)} cells to run or resume into {args.out}")
    status = cells.run_matrix(matrix, progress)
    print(f"wrote {args.out / 'matrix.md'} and {args.out / 'matrix.json'}; exit status {status}")
    return status
