"""[Note: forked children] (qwz/qualify/run/forking.py): a forked child answers as ``python -c``
does -- the same answer, exit status, last stderr line and timeout -- and a `fresh` module
imported in the asker makes the child a new interpreter.

Forking needs an asker with one Python thread, which a pytest-xdist worker is not, so each
question is asked by a child Python process (``ASKER``), once forked and once in a new
interpreter (``forking.sound`` made false), and the two ends are compared."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]

ASKER = """
import builtins, json, signal, sys
from qwz.qualify.run import child, forking

script, stdin_text, timeout_s, fresh, environment = json.loads(sys.stdin.read())
builtins.ASKERS_MARK = True  # only a forked child sees it
signal.signal(signal.SIGTERM, lambda *_: None)  # the asker's own: not the child's
if fresh:
    import fractions  # imported here: a fresh module
ends = {}
for mode in ("forked", "interpreter"):
    if mode == "interpreter":
        forking.sound = lambda: False
    answer = child.ask(script, marker="ANSWER ", environment=environment, timeout_s=timeout_s,
                       stdin_text=stdin_text, fresh=["fractions"] if fresh else [])
    ends[mode] = list(answer) if isinstance(answer, child.NoAnswer) else answer
print("ENDS " + json.dumps(ends))
"""

REPORT = """
import builtins, json, os, signal, sys
import probe_on_the_path
request = json.loads(sys.stdin.read())
print("noise before the answer")
print("ANSWER " + json.dumps({
    "request": request,
    "variable": os.environ.get("QWZ_CHILD_TEST"),
    "unset": "QWZ_ONLY_IN_THE_ASKER" in os.environ,
    "argv": sys.argv,
    "name": __name__,
    "probe": probe_on_the_path.VALUE,
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "forked": getattr(builtins, "ASKERS_MARK", False),
}))
"""


def _ask(tmp_path, script: str, stdin_text="", timeout_s=60.0, fresh=False) -> dict:
    (tmp_path / "probe_on_the_path.py").write_text("VALUE = 'from PYTHONPATH'\n")
    environment = {
        key: value for key, value in os.environ.items() if key != "QWZ_ONLY_IN_THE_ASKER"
    }
    environment.update(QWZ_CHILD_TEST="given", PYTHONPATH=str(tmp_path))
    request = json.dumps([script, stdin_text, timeout_s, fresh, environment])
    done = subprocess.run(
        [sys.executable, "-c", ASKER], input=request, capture_output=True, text=True,
        cwd=ROOT, timeout=300, check=False,
        env=dict(os.environ, QWZ_ONLY_IN_THE_ASKER="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ENDS "))
    return json.loads(line.removeprefix("ENDS "))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="children are forked on Linux")
def test_a_forked_child_answers_as_a_new_interpreter_does(tmp_path):
    ends = _ask(tmp_path, REPORT, stdin_text=json.dumps({"rows": list(range(50_000))}))
    forked, interpreter = ends["forked"], ends["interpreter"]
    assert forked.pop("forked") is True and interpreter.pop("forked") is False
    assert forked == interpreter
    assert forked["request"] == {"rows": list(range(50_000))}  # more than a pipe holds
    assert forked["variable"] == "given" and forked["unset"] is False
    assert forked["argv"] == ["-c"] and forked["name"] == "__main__"
    assert forked["probe"] == "from PYTHONPATH" and forked["sigterm_default"]


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("raise ValueError('no answer here')", ["exit", "exited 1: ValueError: no answer here"]),
        ("import sys; sys.exit(3)", ["exit", "exited 3: (no message)"]),
        ("import sys; sys.exit('said why')", ["exit", "exited 1: said why"]),
        ("print('ANSWER {not json')", ["exit", "its answer is not JSON"]),
        ("print('no marker')", ["exit", "exited 0: (no message)"]),
        ("import time; time.sleep(60)", ["timeout", "over 2 s"]),
    ],
)
def test_a_forked_child_fails_as_a_new_interpreter_does(tmp_path, script, expected):
    ends = _ask(tmp_path, script, timeout_s=2.0)
    for mode in ("forked", "interpreter"):
        kind, message = ends[mode]
        assert kind == expected[0] and message.startswith(expected[1]), (mode, ends)


def test_a_fresh_module_imported_in_the_asker_makes_a_new_interpreter(tmp_path):
    ends = _ask(tmp_path, REPORT, stdin_text="{}", fresh=True)
    assert ends["forked"]["forked"] is False  # asked with fresh: not forked after all
