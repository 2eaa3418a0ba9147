"""Hypothesis profiles for the whole suite, and the compiler its JIT builds use.

``dev`` is the default, ``ci`` loads when the ``CI`` environment variable is set, and
``--hypothesis-profile NAME`` (the hypothesis pytest plugin) overrides both. Every
profile has ``deadline=None``: the first call into torch (and ``torch.compile``) warms
up for seconds, which is not a property failure. Each starts from hypothesis's own
``default`` profile, not from whatever hypothesis loaded on import (its built-in ``ci``
when ``CI`` is set), so ``nightly`` stays randomized on a CI machine.

``CXX`` (unless set, and where g++ is installed) is tests/cxx_cache/g++: the suite's several
DeepSpeed checkouts build the same C++ op once ([Note: one op build per test run] there).

``QWZ_CONFORMANCE_CACHE`` (unless set) is a directory of this test run, made before the xdist
workers start and removed after them: the suite's sixty qualifications of a few subjects run
each subject's conformance table once ([Note: reused conformance tables] in
qwz/qualify/run/conformance_cache.py). tests/multigpu/test_conformance.py calls the table
itself (``run_table``), which never reuses.

The files are handed to the xdist workers longest first ([Note: longest file first] in
tests/file_order.py); ``QWZ_WRITE_DURATIONS=tests/durations.json`` re-measures them.

Tests marked ``nightly`` are deselected unless ``QWZ_NIGHTLY_TESTS=1`` (ci/nightly.sh sets it for
its unit and multigpu runs).
"""

import os
import pathlib
import shutil
import tempfile

from hypothesis import HealthCheck, settings

from tests import file_order

_BASE = settings.get_profile("default")

settings.register_profile("dev", parent=_BASE, max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    parent=_BASE,
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    parent=_BASE,
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

if shutil.which("g++") is not None:
    os.environ.setdefault("CXX", str(pathlib.Path(__file__).resolve().parent / "cxx_cache" / "g++"))


_MADE_CONFORMANCE_CACHE: list[str] = []


def pytest_configure(config):
    # The controller runs first; its workers inherit the variable (they then make none).
    if "QWZ_CONFORMANCE_CACHE" not in os.environ:
        directory = tempfile.mkdtemp(prefix="qwz-conformance-")
        os.environ["QWZ_CONFORMANCE_CACHE"] = directory
        _MADE_CONFORMANCE_CACHE.append(directory)
    # The controller sees every worker's reports; a worker (which has `workerinput`) writes none.
    target = os.environ.get("QWZ_WRITE_DURATIONS")
    if target and not hasattr(config, "workerinput"):
        writer = file_order.DurationWriter(pathlib.Path(target).resolve(), config.rootpath)
        config.pluginmanager.register(writer, "qwz-durations")


def pytest_unconfigure(config):
    for directory in _MADE_CONFORMANCE_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop("QWZ_CONFORMANCE_CACHE", None)


NIGHTLY = os.environ.get("QWZ_NIGHTLY_TESTS") == "1"
"""``QWZ_NIGHTLY_TESTS=1`` (ci/nightly.sh) runs the tests marked ``nightly``; otherwise they
are deselected (reported as such, never as passed): they repeat a check at more world sizes,
variants and orders than a pull request's CI has time for."""


def pytest_collection_modifyitems(config, items):
    # The test command runs `pytest -n 2 --dist loadfile`: each file on one xdist worker, so a
    # file's ranks and module fixtures are made once (pytest 9 ignores the nodeid suffix that
    # `--dist loadgroup` groups by, pytest-xdist#1386: each file's fixtures were made on both
    # workers). tests/unit/test_workflows.py checks the test command keeps a file together.
    if not NIGHTLY:
        nightly = [item for item in items if item.get_closest_marker("nightly") is not None]
        if nightly:
            config.hook.pytest_deselected(items=nightly)
            items[:] = [item for item in items if item.get_closest_marker("nightly") is None]
    # With --no-loadscope-reorder (ci/test.sh) xdist hands the files out in this order.
    file_order.reorder(items, file_order.load())
