"""Whether this process may fork a helper process instead of starting a new interpreter.

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
run/launch.py, [Note: forked children] in run/child.py.
"""

from __future__ import annotations

import sys
import threading


def sound() -> bool:
    """[Note: forking is sound]: whether this process may fork a helper now."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    import torch
    import torch.distributed as dist

    return not torch.cuda.is_available() and not (dist.is_available() and dist.is_initialized())
