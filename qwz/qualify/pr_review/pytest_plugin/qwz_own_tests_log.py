"""The pytest plugin ``qwz-qualify review`` loads into the PR's own test run (``-p
qwz_own_tests_log``, this directory last on ``PYTHONPATH``): one JSON line per event, appended
and flushed to the file ``$QWZ_OWN_TESTS_LOG`` names as it happens, so a run killed at its
time limit still tells which test was running ([Note: the PR's own tests] in
qwz/qualify/pr_review/own_tests.py).

Events (``"event"``): ``rootdir`` (the directory its node ids are relative to),
``collect-error`` (a module that does not collect: its node id and message), ``collected``
(the node ids pytest will run), ``deselected`` (node ids), ``start`` (a test begins),
``report`` (one phase of a test: ``when`` setup/call/teardown, ``outcome``, ``message``,
``seconds``, ``xfail`` where pytest expected it to fail), ``exit`` (``pytest.exit`` or Ctrl-C,
with its message), ``internal-error`` and ``finish`` (pytest's exit status).

Standalone on purpose: it runs inside the subject's pytest process, beside DeepSpeed's own
conftest, and imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os

LOG_ENV = "QWZ_OWN_TESTS_LOG"
MESSAGE_CHARS = 500

_log = None


def _write(event: dict) -> None:
    if _log is not None:
        _log.write(json.dumps(event) + "\n")
        _log.flush()


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0][:MESSAGE_CHARS] if lines else ""


def _error_line(text: str) -> str:
    """The exception line of a pytest report's text: its last ``E`` line, else its last."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    raised = [line[1:].strip() for line in lines if line.startswith("E ")]
    found = raised or lines
    return found[-1][:MESSAGE_CHARS] if found else ""


def _message(report) -> str:
    """Why a report is not a plain pass: a skip's reason, a failure's exception line."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")[:MESSAGE_CHARS]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _first_line(crash.message)
    return _error_line(getattr(report, "longreprtext", "") or str(longrepr))


def pytest_configure(config) -> None:
    global _log
    path = os.environ.get(LOG_ENV)
    if path and _log is None:
        _log = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the session)
        _write({"event": "rootdir", "path": str(config.rootpath)})


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"event": "collect-error", "nodeid": report.nodeid, "message": _message(report)})


def pytest_deselected(items) -> None:
    _write({"event": "deselected", "nodeids": [item.nodeid for item in items]})


def pytest_collection_finish(session) -> None:
    _write({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report) -> None:
    event = {
        "event": "report",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "message": _message(report),
        "seconds": round(float(getattr(report, "duration", 0.0)), 3),
    }
    if hasattr(report, "wasxfail"):
        event["xfail"] = str(report.wasxfail)
    _write(event)


def pytest_keyboard_interrupt(excinfo) -> None:
    _write({"event": "exit", "message": _first_line(str(excinfo.value)) or excinfo.typename})


def pytest_internalerror(excrepr, excinfo) -> None:
    _write({"event": "internal-error", "message": _error_line(str(excrepr))})


def pytest_sessionfinish(session, exitstatus) -> None:
    _write({"event": "finish", "exitstatus": int(exitstatus)})


def pytest_unconfigure(config) -> None:
    global _log
    if _log is not None:
        _log.close()
        _log = None
