"""Which of tonight's failures a changed judge explains, for ci/nightly.sh and nightly-bisect.sh.

A failure is *judge-only* when the baseline's own observations fail the same check under today's
rules ([Note: rejudging], qualify/evidence/rejudge.py): the code did not change its result, the
judge did. Such a cell is no regression and nothing to bisect. Every other failure -- a check
that fails tonight and passes the baseline under today's rules, a cell without a baseline, a
crash -- is the code's.

    python -m qwz.qualify.review.judge_only BASELINE_MATRIX_DIR TONIGHT_MATRIX_DIR

prints one line per failed cell, ``judge-only CELL: ...`` or ``code CELL: ...``, and exits 0
when every failed cell is judge-only, 1 when one is not, 2 when a table cannot be read.
"""

from __future__ import annotations

import pathlib
import sys

from qwz.qualify.evidence.rejudge import rejudged
from qwz.qualify.evidence.schema import Record, RecordError
from qwz.qualify.review.matrix import cell_record, load_matrix

BAD = ("fail", "inconclusive")


def code_failures(baseline: Record, tonight: Record) -> list[str]:
    """Tonight's failed checks (under today's rules) that the baseline does not fail too."""
    before = {check.name: check.status for check in rejudged(baseline).checks}
    return [
        check.name
        for check in rejudged(tonight).checks
        if check.status in BAD and before.get(check.name) not in BAD
    ]


def classify(baseline_dir: pathlib.Path, tonight_dir: pathlib.Path) -> list[tuple[str, bool, str]]:
    """(cell id, judge-only?, why) for every cell of tonight that did not pass."""
    baseline, tonight = load_matrix(baseline_dir), load_matrix(tonight_dir)
    rows = []
    for cell in tonight.cells:
        if cell.status in ("PASS", "not run"):
            continue
        before = baseline.cell(cell.id)
        if cell.record is None or before is None or before.record is None:
            rows.append((cell.id, False, f"{cell.status}, no record pair to explain it"))
            continue
        ours, theirs = cell_record(tonight_dir, cell), cell_record(baseline_dir, before)
        assert ours is not None and theirs is not None
        failed = [c.name for c in rejudged(ours).checks if c.status in BAD]
        code = code_failures(theirs, ours)
        if code:
            rows.append((cell.id, False, "fails " + ", ".join(code) + " (the baseline does not)"))
        else:
            moved = [
                item.text() for item in rejudged(theirs).judge_changes if item.name in set(failed)
            ]
            rows.append(
                (
                    cell.id,
                    True,
                    "the baseline fails "
                    + ", ".join(failed)
                    + " under today's rules too"
                    + (f" ({'; '.join(moved[:3])})" if moved else ""),
                )
            )
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    try:
        rows = classify(pathlib.Path(argv[0]), pathlib.Path(argv[1]))
    except RecordError as error:
        print(f"judge_only: {error}", file=sys.stderr)
        return 2
    for cell_id, judge_only, why in rows:
        print(f"{'judge-only' if judge_only else 'code'} {cell_id}: {why}")
    return 0 if all(judge_only for _, judge_only, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
