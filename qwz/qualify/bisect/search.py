"""The binary search itself, over indices of the first-parent range (0 is the good commit,
``last`` the bad one), from the verdicts so far; pure, so its rules are tested alone.

The bounds are the lowest bad index and the highest good index below it. The next commit to
test is the untested one between them nearest to their middle (a skipped commit is never
tested again; its neighbours are). When nothing untested is left between the bounds, the
first bad commit is the upper bound if the bounds are adjacent, else it is hidden: it is one
of the skipped commits between them or the upper bound (``git bisect``'s "could be any of").
"""

from __future__ import annotations

from typing import NamedTuple


class Answer(NamedTuple):
    first_bad: int | None
    """The index of the first bad commit; None when skipped commits hide it."""
    candidates: list[int]
    """Every index that may be the first bad commit (one when it was found)."""


def bounds(verdicts: dict[int, str], last: int) -> tuple[int, int]:
    """(highest good index below the first bad one, lowest bad index)."""
    bad = min((index for index, verdict in verdicts.items() if verdict == "bad"), default=last)
    good = max(
        (index for index, verdict in verdicts.items() if verdict == "good" and index < bad),
        default=0,
    )
    return good, bad


def next_index(verdicts: dict[int, str], last: int) -> int | None:
    """The next index to test, or None when the search is over."""
    good, bad = bounds(verdicts, last)
    untested = [index for index in range(good + 1, bad) if index not in verdicts]
    if not untested:
        return None
    middle = (good + bad) / 2
    return min(untested, key=lambda index: (abs(index - middle), index))


def answer(verdicts: dict[int, str], last: int) -> Answer:
    """The result once ``next_index`` is None."""
    good, bad = bounds(verdicts, last)
    if bad == good + 1:
        return Answer(bad, [bad])
    return Answer(None, [*range(good + 1, bad), bad])
