"""Forking a helper process instead of starting a new interpreter: whether it is sound, and a
forked ``python -c``.

[Note: forking is sound]
A new Python interpreter imports torch (2-3 s of CPU) and whatever its task needs before it
does anything; a qualification starts several (its ranks, and for a DeepSpeed subject the
preflight's and the conformance table's children), and on a small machine that was most of a
short run's CPU. Forking this process instead starts a helper with its imports done. It is
sound only where nothing in this process would be copied half-done into the child:

- Linux (the platform whose fork the helpers are written and tested for);
- one Python thread (a thread holding a lock at the fork leaves that lock held forever in the
  child; a pytest-xdist worker has several, so its helpers are spawned);
- torch sees no GPU (the CUDA driver is not fork-safe once loaded, and a device count loads
  it): a host with a GPU starts new interpreters as before;
- no process group in this process (its store and sockets would be shared with the child).

Native library threads that handle fork themselves (OpenBLAS's pool, which numpy starts at
import) do not count. Who forks says what the child starts from: [Note: forked ranks] in
run/launch.py, [Note: forked children] below.

[Note: forked children]
A child is ``python -c script`` with the caller's environment and stdin: a new interpreter,
which imports torch again before the script starts (2-3 s of CPU, more than most answers
take). Where [Note: forking is sound] (above) and none of the caller's `fresh`
modules is imported here, the child is this process forked instead, made to look like that
interpreter: the environment replaced by the caller's, ``PYTHONPATH``'s entries first on
``sys.path``, ``sys.argv`` ``["-c"]``, default SIGINT and SIGTERM, stdin, stdout and stderr on
pipes, the script run as ``__main__``, an uncaught exception printed and exit status 1, as
Python does. What it does not redo is what this process has already imported (torch, qwz):
the same files a new interpreter would import. A module whose answer depends on the path the
child is given (``deepspeed`` before ``--deepspeed-src`` is put on this process's path) is
`fresh`: imported here, it makes the child a new interpreter. Either way the answer is read
the same, and a timeout kills the child as ``subprocess.run`` does.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import selectors
import signal
import sys
import threading
import time
import traceback
from typing import Any, NamedTuple, NoReturn

CHUNK = 65536


def sound() -> bool:
    """[Note: forking is sound]: whether this process may fork a helper now."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    import torch
    import torch.distributed as dist

    return not torch.cuda.is_available() and not (dist.is_available() and dist.is_initialized())


class Ended(NamedTuple):
    """How a child ended: its exit status (negative: the signal) and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def python_c(
    script: str, environment: dict[str, str], timeout_s: float, stdin_text: str | None
) -> Ended | None:
    """[Note: forked children]: `script` in this process forked, as ``python -c`` would run
    it with `environment` and `stdin_text`; None when it outlasted
    `timeout_s` (it is killed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        _run_as_python_c(script, environment, stdin_r, stdout_w, stderr_w)
    for fd in (stdin_r, stdout_w, stderr_w):
        os.close(fd)
    data = (stdin_text or "").encode()
    try:
        output = _exchange(stdin_w, data, [stdout_r, stderr_r], time.monotonic() + timeout_s)
    except BaseException:  # a Ctrl-C here: the child goes too, as subprocess.run's does
        _kill(pid)
        raise
    if output is None:
        _kill(pid)
        return None
    _, status = os.waitpid(pid, 0)
    stdout, stderr = (output[fd].decode(errors="replace") for fd in (stdout_r, stderr_r))
    return Ended(os.waitstatus_to_exitcode(status), stdout, stderr)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _exchange(
    stdin_w: int, data: bytes, readers: list[int], deadline: float
) -> dict[int, bytes] | None:
    """Write `data` to `stdin_w` and read `readers` to their end, closing each; None at the
    deadline."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in readers}
    with selectors.DefaultSelector() as selector:
        for fd in readers:
            selector.register(fd, selectors.EVENT_READ)
        if data:
            os.set_blocking(stdin_w, False)
            selector.register(stdin_w, selectors.EVENT_WRITE)
        else:
            os.close(stdin_w)
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                for key, _ in selector.select(remaining):
                    if key.fd == stdin_w:
                        data = _write_some(stdin_w, data)
                        if not data:
                            selector.unregister(stdin_w)
                            os.close(stdin_w)
                        continue
                    chunk = os.read(key.fd, CHUNK)
                    if chunk:
                        chunks[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
        finally:
            for key in list(selector.get_map().values()):
                os.close(key.fd)
    return {fd: b"".join(parts) for fd, parts in chunks.items()}


def _write_some(fd: int, data: bytes) -> bytes:
    """What of `data` is left after one write (nothing when the reader has gone)."""
    try:
        return data[os.write(fd, data[:CHUNK]) :]
    except BlockingIOError:
        return data
    except BrokenPipeError:
        return b""


def _run_as_python_c(
    script: str, environment: dict[str, str], stdin: int, stdout: int, stderr: int
) -> NoReturn:
    """In the forked child: become ``python -c script`` ([Note: forked children]) and exit
    with its status."""
    code = 1
    try:
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True
        )
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(environment)
        first = [path for path in environment.get("PYTHONPATH", "").split(os.pathsep) if path]
        sys.path[:] = ["", *first, *(path for path in sys.path if path not in first)]
        sys.argv = ["-c"]
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(script, "<string>", "exec"), namespace)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _exit_status(value: Any) -> int:
    """What ``python`` exits with for ``sys.exit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
