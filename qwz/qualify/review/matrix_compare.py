"""The regression gate between two matrix directories, cell by cell.

Each cell id present in either table (qualify/review/matrix.py) is judged on its own:

  - both sides have a record: ``compare.compare_files`` on the pair (the single-record
    gate, its rules and its signature requirement); its lines are prefixed with the cell;
  - only the baseline has a record: a regression ("lost"): a cell that stopped producing
    evidence -- refused, crashed, not run, or gone from the spec -- must never let the gate
    pass;
  - only the candidate has a record: reported (a new cell has no baseline until it is
    promoted), not judged;
  - neither has one (both not run): reported with the candidate's reason.

The result is the worst cell's: 2 if any pair is not comparable, else 1 if any cell
regressed, else 0. Two tables that share no cell are not comparable.
"""

from __future__ import annotations

import pathlib

from qwz.qualify.evidence.schema import RecordError
from qwz.qualify.evidence.signing import SigningKey
from qwz.qualify.review.compare import Comparison, Status, compare_files
from qwz.qualify.review.matrix import Matrix, MatrixCell, load_matrix


def _side_text(cell: MatrixCell | None) -> str:
    if cell is None:
        return "absent from its spec"
    return cell.status + (f" ({cell.reason})" if cell.reason else "")


TALLY = {
    Status.NO_REGRESSION: "compared without regression",
    Status.REGRESSION: "regressed",
    Status.NOT_COMPARABLE: "not comparable",
    "lost": "lost",
    "new": "new",
    "neither": "without a record on either side",
}
"""How the result line counts the cells: each pair compared by its status, the rest by kind."""


def _one_sided(
    cell_id: str, before: MatrixCell | None, after: MatrixCell | None
) -> tuple[Status, str, str]:
    """A cell without records on both sides: (its status, its tally, its line)."""
    if before is not None and before.record is not None:
        return (
            Status.REGRESSION,
            TALLY["lost"],
            (
                f"REGRESSION: cell {cell_id}: lost: the baseline has a {before.status} record, "
                f"the candidate none: {_side_text(after)}"
            ),
        )
    if after is not None and after.record is not None:
        return (
            Status.NO_REGRESSION,
            TALLY["new"],
            (
                f"cell {cell_id}: new: the candidate's record ({after.status}) has no baseline "
                f"(baseline: {_side_text(before)}); promote it to gate this cell"
            ),
        )
    return (
        Status.NO_REGRESSION,
        TALLY["neither"],
        (
            f"cell {cell_id}: not run in either: baseline {_side_text(before)}; candidate "
            f"{_side_text(after)}"
        ),
    )


def _tagged(line: str, cell_id: str) -> str:
    """`line` of a cell's comparison with the cell named after its kind, so a line of a
    regression still starts with ``REGRESSION: `` (what junit.py and summaries read)."""
    for kind in ("REGRESSION: ", "NOT COMPARABLE: "):
        if line.startswith(kind):
            return f"{kind}cell {cell_id}: {line.removeprefix(kind)}"
    return f"cell {cell_id}: {line}"


def _ids(baseline: Matrix, candidate: Matrix) -> list[str]:
    ids = [cell.id for cell in baseline.cells]
    return ids + [cell.id for cell in candidate.cells if cell.id not in set(ids)]


def compare_matrices(
    baseline_dir: pathlib.Path,
    candidate_dir: pathlib.Path,
    *,
    memory_growth_pct: float = 10.0,
    require_signature: bool = False,
    key: SigningKey | None = None,
) -> Comparison:
    """Judge every cell of ``candidate_dir`` against ``baseline_dir`` (module docstring)."""
    try:
        baseline, candidate = load_matrix(baseline_dir), load_matrix(candidate_dir)
    except RecordError as error:
        return Comparison(
            Status.NOT_COMPARABLE, [f"NOT COMPARABLE: {error}", "result: not comparable"]
        )
    header = [
        f"baseline matrix: {baseline.name} ({baseline_dir}, {baseline.created_at})",
        f"candidate matrix: {candidate.name} ({candidate_dir}, {candidate.created_at})",
    ]
    shared = {cell.id for cell in baseline.cells} & {cell.id for cell in candidate.cells}
    if not shared:
        return Comparison(
            Status.NOT_COMPARABLE,
            [*header, "NOT COMPARABLE: the two tables share no cell", "result: not comparable"],
        )
    worst, lines, counts = Status.NO_REGRESSION, [], dict.fromkeys(TALLY.values(), 0)
    for cell_id in _ids(baseline, candidate):
        before, after = baseline.cell(cell_id), candidate.cell(cell_id)
        if before is not None and after is not None and before.record and after.record:
            result = compare_files(
                baseline_dir / before.record,
                candidate_dir / after.record,
                memory_growth_pct=memory_growth_pct,
                require_signature=require_signature,
                key=key,
            )
            status = result.status
            lines += [_tagged(line, cell_id) for line in result.lines]
            counts[TALLY[status]] += 1
        else:
            status, kind, line = _one_sided(cell_id, before, after)
            lines.append(line)
            counts[kind] += 1
        worst = max(worst, status)
    tally = ", ".join(f"{count} {kind}" for kind, count in counts.items() if count)
    verdict = {
        Status.NO_REGRESSION: "no regression",
        Status.REGRESSION: "regression",
        Status.NOT_COMPARABLE: "not comparable",
    }[worst]
    return Comparison(worst, [*header, *lines, f"result: {verdict} ({tally})"])
