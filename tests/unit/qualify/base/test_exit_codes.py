"""One meaning per exit status across every command ([Note: exit statuses] in
qwz/qualify/base/exit_codes.py; issue 49: exit 1 meant a FAIL, the user's timeout, a harness crash
and tracebacks from three commands). Each command's own statuses are read from its code
here, so a command that starts giving another status fails this file."""

from __future__ import annotations

import signal

from qwz.qualify.base import exit_codes
from qwz.qualify.bisect import bisect_command as bisect
from qwz.qualify.evidence import harness_error
from qwz.qualify.matrix import cells
from qwz.qualify.review import compare, pr_review
from qwz.qualify.review import matrix as table
from qwz.qualify.review.matrix import MatrixCell
from qwz.qualify.run.launch import Interrupted


def test_the_note_and_the_table_name_every_status():
    for code in exit_codes.MEANINGS:
        assert f"  {code} " in exit_codes.__doc__, code
        assert f"  {code:<4} " in exit_codes.epilog(), code
    assert exit_codes.CANNOT_RUN_HERE == 5 and "runner lacks" in exit_codes.MEANINGS[5]


def test_every_commands_statuses_are_the_documented_ones():
    given = {
        "run": set(exit_codes.VERDICT_EXITS.values()) | {harness_error.HARNESS_ERROR_EXIT},
        "compare": {int(status) for status in compare.Status},
        "matrix": {exit_codes.PASS, exit_codes.FAIL, exit_codes.INCONCLUSIVE,
                   harness_error.HARNESS_ERROR_EXIT, cells.REFUSED_EXIT},
        "review": set(pr_review.EXITS.values()),
        "bisect": {bisect.FOUND, bisect.NOTHING, bisect.REFUSED, bisect.HIDDEN},
        "stopped": {Interrupted(signal.SIGINT).exit_code, Interrupted(signal.SIGTERM).exit_code},
    }  # fmt: skip
    for command, statuses in given.items():
        assert statuses <= set(exit_codes.MEANINGS), (command, statuses)


def test_one_means_the_subject_failed_and_nothing_else():
    """bisect said 1 for "nothing to find" (its bad head is not bad): a request whose premise
    is false is refused, as a good head that is not good already was."""
    assert bisect.NOTHING == bisect.REFUSED == exit_codes.REFUSED
    assert compare.Status.REGRESSION == exit_codes.FAIL
    assert exit_codes.VERDICT_EXITS["FAIL"] == exit_codes.FAIL


def test_a_matrix_with_a_failed_cell_exits_as_a_run_would():
    def cell(status: str) -> MatrixCell:
        return MatrixCell(id=status, group=None, axes={}, status=status, kind="ran", reason="",
                          arguments=[], record=None, digest=None, wall_s=None)  # fmt: skip

    assert table.status_of([cell("PASS"), cell("FAIL")]) == exit_codes.FAIL
    assert table.status_of([cell("PASS"), cell("HARNESS-ERROR")]) == exit_codes.HARNESS_ERROR
    assert table.status_of([cell("PASS"), cell("INCONCLUSIVE")]) == exit_codes.INCONCLUSIVE
    assert table.status_of([cell("PASS")]) == exit_codes.PASS
