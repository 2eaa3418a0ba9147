"""[Note: forked ranks] (qwz/qualify/run/launch.py): a world given ``preload`` forks its ranks
from a launcher with one Python thread and gloo, and each forked rank is set up as a spawned
one is; anywhere else the ranks are spawned.

The launcher must have one Python thread, which a pytest-xdist worker has not, so each world
here is made by a child Python process, inside ``signals_interrupt`` as ``launch`` makes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from qwz.qualify.run.launch import import_for_fork, start_method

pytestmark = pytest.mark.multigpu

LAUNCHER = """
import json, sys, threading
from qwz.qualify.run.launch import LocalWorld, signals_interrupt
from tests.multigpu.test_forked_ranks import rank_setup

preload, extra_thread = json.loads(sys.argv[1])
if extra_thread:
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
with signals_interrupt(), LocalWorld(2, backend="gloo", preload=preload) as world:
    print(json.dumps({"start": world.start_method, "ranks": world.run(rank_setup)}))
"""


def rank_setup() -> dict:
    """What a rank was started with: its signal dispositions, threads, process group and the
    modules the launcher imported for it."""
    import torch
    import torch.distributed as dist

    return {
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "threads": torch.get_num_threads(),
        "leads_its_group": os.getpgid(0) == os.getpid(),
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "dynamo_imported": "torch._dynamo" in sys.modules,
    }


def _launch(preload, extra_thread=False) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, json.dumps([preload, extra_thread])],
        capture_output=True, text=True, cwd=root, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
@pytest.mark.skipif(torch.cuda.is_available(), reason="ranks fork only where torch sees no GPU")
def test_a_world_with_preload_forks_ranks_set_up_as_spawned_ones():
    forked = _launch(["torch._dynamo"])
    spawned = _launch(None)
    assert (forked["start"], spawned["start"]) == ("fork", "spawn")
    for ranks in (forked["ranks"], spawned["ranks"]):
        assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
        for rank in ranks:
            # the launcher raises Interrupted on SIGTERM; a rank must not inherit that
            assert rank["sigterm_default"] and rank["sigint_ignored"], rank
            assert rank["threads"] == 1 and rank["leads_its_group"], rank
    assert all(rank["dynamo_imported"] for rank in forked["ranks"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
def test_a_launcher_with_another_python_thread_spawns():
    assert _launch(["torch._dynamo"], extra_thread=True)["start"] == "spawn"


def test_the_start_method_is_fork_only_where_the_note_allows(monkeypatch):
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert start_method("gloo", ()) == "fork"
    assert start_method("gloo", None) == "spawn"
    assert start_method("nccl", ("torch._dynamo",)) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert start_method("gloo", ()) == "spawn"
    monkeypatch.undo()
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert start_method("gloo", ()) == "spawn"
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert start_method("gloo", ()) == "spawn"


def test_the_preload_is_imported_early_only_where_ranks_will_be_forked(monkeypatch, tmp_path):
    """The CLI imports the ranks' modules before its conformance child forks
    (``import_for_fork``); where the ranks are spawned it leaves them to the ranks."""
    for name in ("qwz_preload_spawned", "qwz_preload_forked"):
        (tmp_path / f"{name}.py").write_text("")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert import_for_fork("gloo", ("qwz_preload_spawned",)) == "spawn"
    assert "qwz_preload_spawned" not in sys.modules
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert import_for_fork("gloo", ("qwz_preload_forked",)) == "fork"
    assert "qwz_preload_forked" in sys.modules
