"""The order the test command hands files to its two xdist workers: longest first.

[Note: longest file first]
``bash ci/test.sh`` runs ``pytest -n 2 --dist loadfile``: each file goes whole to one worker,
and a worker is given the next file in the queue when it has two tests or fewer left.
pytest-xdist's own queue order (``--loadscope-reorder``, its default) is most tests first. On
this suite that puts the long files with one to three tests (the bisect, the matrix, the
review, the checkouts: 20-60 s each) last, and one worker can hold two or three of them at
once while the other has finished: an 82 s tail on a 584 s run, where the other core only
helped the last worker's ranks.

So the test command passes ``--no-loadscope-reorder``, and the collection hook in
tests/conftest.py puts the files in the order of :func:`longest_first`: files
``tests/durations.json`` does not know first (a new file's cost is unknown; early, even a
long one leaves the other worker time to balance it), then the known ones by their measured
seconds, longest first (LPT, the classic greedy schedule for identical machines). A file's
own tests keep their order (module fixtures, process groups made once). The order is a
function of the collected node ids and the committed file alone, so both workers collect the
same list (xdist refuses to run otherwise).

A stale entry costs balance, never a result. ``QWZ_WRITE_DURATIONS=tests/durations.json bash
ci/test.sh`` re-measures: the controller sums each file's setup, call and teardown seconds
over the run and merges them into the file (files that did not run keep their entry; an
entry for a file that is gone is dropped).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

DURATIONS = pathlib.Path(__file__).resolve().parent / "durations.json"
"""Measured seconds per test file, summed over its tests' setup, call and teardown."""


def file_of(nodeid: str) -> str:
    """The file part of a pytest node id (``tests/unit/test_x.py::test_y[1]``)."""
    return nodeid.split("::", 1)[0]


def load(path: pathlib.Path = DURATIONS) -> dict[str, float]:
    """The durations file as {file: seconds}; an absent file is no knowledge, not an error."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(
        isinstance(key, str) and isinstance(value, (int, float)) and value >= 0
        for key, value in data.items()
    ):
        raise ValueError(f"{path}: expected an object of test file -> non-negative seconds")
    return {key: float(value) for key, value in data.items()}


def longest_first(nodeids: Sequence[str], durations: Mapping[str, float]) -> list[int]:
    """The indices of `nodeids` reordered: whole files, unknown files first in collection
    order, then known files by descending seconds (ties in collection order); each file's
    own tests in their collected order."""
    files: dict[str, list[int]] = {}
    for index, nodeid in enumerate(nodeids):
        files.setdefault(file_of(nodeid), []).append(index)
    order = list(files)  # collection order of first appearance
    unknown = [name for name in order if name not in durations]
    known = sorted((name for name in order if name in durations), key=lambda n: -durations[n])
    return [index for name in unknown + known for index in files[name]]


def merged(
    before: Mapping[str, float], measured: Mapping[str, float], root: pathlib.Path
) -> dict[str, float]:
    """`before` updated with this run's `measured` seconds, without files no longer under
    `root`, longest first (so the committed file reads as the schedule)."""
    combined = {**before, **measured}
    kept = {name: round(s, 1) for name, s in combined.items() if (root / name).is_file()}
    return dict(sorted(kept.items(), key=lambda item: (-item[1], item[0])))


class DurationWriter:
    """A pytest plugin for the controller (or a run without xdist): sums the seconds of every
    test report per file, and merges them into `path` at the end of the session."""

    def __init__(self, path: pathlib.Path, root: pathlib.Path) -> None:
        self.path, self.root = path, root
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        name = file_of(report.nodeid)
        self.seconds[name] = self.seconds.get(name, 0.0) + float(report.duration)

    def pytest_sessionfinish(self, session) -> None:
        if not self.seconds:
            return
        table = merged(load(self.path), self.seconds, self.root)
        self.path.write_text(json.dumps(table, indent=1) + "\n")


def reorder(items: list, durations: Mapping[str, float]) -> None:
    """`items` (pytest's collected items) in place, in :func:`longest_first` order."""
    order = longest_first([item.nodeid for item in items], durations)
    items[:] = [items[index] for index in order]
