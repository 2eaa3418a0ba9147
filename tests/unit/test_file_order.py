"""The order the test command hands its files to the xdist workers ([Note: longest file
first], tests/file_order.py): longest first, each file whole, and xdist told not to re-sort."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import file_order
from tests.unit.test_workflows import args_of_the_test_command

ROOT = pathlib.Path(__file__).resolve().parents[2]

FILES = st.sampled_from([f"tests/test_{name}.py" for name in "abcdef"])
NODEIDS = st.lists(st.tuples(FILES, st.integers(0, 9)), max_size=30).map(
    lambda pairs: [f"{name}::test_{i}[{n}]" for n, (name, i) in enumerate(pairs)]
)
DURATIONS = st.dictionaries(FILES, st.floats(0, 1000, allow_nan=False))


@given(NODEIDS, DURATIONS)
def test_longest_first_keeps_files_whole_and_orders_them_by_seconds(nodeids, durations):
    order = file_order.longest_first(nodeids, durations)
    assert sorted(order) == list(range(len(nodeids)))  # a permutation: nothing lost or doubled
    files = [file_order.file_of(nodeids[i]) for i in order]
    runs = [name for k, name in enumerate(files) if k == 0 or files[k - 1] != name]
    assert len(runs) == len(set(runs)), f"a file split in two: {runs}"
    for name in runs:  # each file's tests in their collected order
        mine = [i for i in order if file_order.file_of(nodeids[i]) == name]
        assert mine == sorted(mine)
    known = [name in durations for name in runs]
    assert known == sorted(known), "an unknown file after a known one"
    seconds = [durations[name] for name in runs if name in durations]
    assert seconds == sorted(seconds, reverse=True)
    assert file_order.longest_first([nodeids[i] for i in order], durations) == list(
        range(len(order))
    ), "not a fixed point: the workers' order would depend on the order collected"


def test_this_session_collected_its_files_longest_first(request):
    """tests/conftest.py applies the order: the items of this very session are already in
    it (a collection left in pytest's order, by folder and name, is not)."""
    for flag, option in (("--failed-first", "failedfirst"), ("--new-first", "newfirst")):
        if request.config.getoption(option, False):
            pytest.skip(f"{flag} reorders the collection after tests/conftest.py, by design")
    nodeids = [item.nodeid for item in request.session.items]
    assert file_order.longest_first(nodeids, file_order.load()) == list(range(len(nodeids)))


def test_the_collection_hook_puts_the_files_longest_first(request):
    """tests/conftest.py's collection hook, given items in pytest's own order (by folder and
    name), hands them back longest first. The session check above needs a session of several
    files to say anything; this one holds in any session, one file run alone included."""
    conftest = ROOT / "tests" / "conftest.py"
    (hook,) = [
        plugin.pytest_collection_modifyitems
        for plugin in request.config.pluginmanager.get_plugins()
        if getattr(plugin, "__file__", None) == str(conftest)
    ]
    names = sorted(file_order.load())
    items = [
        SimpleNamespace(nodeid=f"{name}::test_{i}", get_closest_marker=lambda marker: None)
        for name in names
        for i in range(2)
    ]
    expected = [
        items[i].nodeid
        for i in file_order.longest_first([x.nodeid for x in items], file_order.load())
    ]
    assert expected != [item.nodeid for item in items]  # pytest's order is not already it
    hook(config=request.config, items=items)
    assert [item.nodeid for item in items] == expected


def test_the_committed_durations_name_only_test_files_that_exist():
    durations = file_order.load()
    assert durations, "tests/durations.json is missing or empty"
    gone = [name for name in durations if not (ROOT / name).is_file()]
    assert gone == [], f"entries for files that are gone (see tests/file_order.py): {gone}"
    assert all(name.startswith("tests/") and name.endswith(".py") for name in durations)


def test_a_malformed_durations_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"tests/test_a.py": "long"}))
    try:
        file_order.load(path)
    except ValueError as error:
        assert str(path) in str(error)
    else:
        raise AssertionError("a non-number of seconds was accepted")
    assert file_order.load(tmp_path / "absent.json") == {}


def test_the_writer_sums_each_files_reports_and_merges_them(tmp_path):
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / "tests" / name).write_text("")
    path = tmp_path / "durations.json"
    before = {"tests/test_a.py": 9.0, "tests/test_c.py": 1.0, "tests/test_gone.py": 5.0}
    path.write_text(json.dumps(before))
    writer = file_order.DurationWriter(path, tmp_path)
    for nodeid, seconds in [
        ("tests/test_b.py::test_x", 2.0),
        ("tests/test_b.py::test_x", 3.25),  # its call after its setup
        ("tests/test_c.py::test_y[1]", 4.0),
    ]:
        writer.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    writer.pytest_sessionfinish(session=None)
    written = json.loads(path.read_text())
    # b measured (to 0.1 s), c re-measured, a kept from before, the gone file dropped;
    # longest first.
    assert list(written) == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]
    assert written["tests/test_a.py"] == 9.0 and written["tests/test_c.py"] == 4.0
    assert abs(written["tests/test_b.py"] - 5.25) <= 0.05


TEST_FILE = """
import os, pathlib, time

def test_{name}_{i}():
    with open(pathlib.Path(__file__).with_name("started.log"), "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + " {name}\\n")
    time.sleep(0.2)
"""

CONFTEST = """
import pathlib, sys
sys.path.insert(0, {root!r})
from tests import file_order
from tests.unit.test_workflows import args_of_the_test_command

def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).with_name("durations.json")
    file_order.reorder(items, file_order.load(here))
"""


def test_the_test_command_starts_each_worker_on_a_longest_file(tmp_path):
    """With the test command's own flags, the first file each worker runs is one of the two
    longest (xdist's default would start on the file with most tests, here `many`)."""
    flags = [word for word in args_of_the_test_command() if word not in ("tests", "$@")]
    counts = {"long": 1, "mid": 1, "many": 5, "few": 2}
    for name, count in counts.items():
        (tmp_path / f"test_{name}.py").write_text(
            "".join(TEST_FILE.format(name=name, i=i) for i in range(count))
        )
    (tmp_path / "durations.json").write_text(
        json.dumps({"test_long.py": 100, "test_mid.py": 50, "test_many.py": 5, "test_few.py": 1})
    )
    (tmp_path / "conftest.py").write_text(CONFTEST.format(root=str(ROOT)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *flags, "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first: dict[str, str] = {}
    for row in (tmp_path / "started.log").read_text().split("\n"):
        if row:
            worker, name = row.split()
            first.setdefault(worker, name)
    assert sorted(first.values()) == ["long", "mid"], first
