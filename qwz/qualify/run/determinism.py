"""The deterministic settings every rank of a qualification runs under, and their record.

[Note: deterministic ranks]
``step1-exact`` compares masters bit for bit and ``reproduced`` compares hashes across
runs; both need kernels that give the same bits for the same inputs. While
:func:`deterministic` is entered, a rank runs with

* ``torch.use_deterministic_algorithms(True, warn_only=True)``: deterministic kernels
  where torch has them; an op without one warns instead of failing the run (the warning
  names it), which is the safe setting for arbitrary subjects;
* ``fill_uninitialized_memory`` off: filling every ``torch.empty`` with NaN would change
  the timed steps, and qwz's buffers are written before they are read;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless already set (cuBLAS is deterministic only with
  a fixed workspace; it is read when the first cuBLAS handle is made, so this runs before
  any matmul of the rank);
* cuDNN deterministic, its autotuner (``benchmark``) off.

On exit every setting is restored, so a test process that runs a qualification inside a
reused rank leaves the rank as it found it. The settings go into the record's environment
and its fingerprint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from qwz.qualify.evidence.schema import Determinism

CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""One of the two values cuBLAS documents as deterministic."""


def current() -> Determinism:
    """The settings in effect in this process."""
    return Determinism(
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        fill_uninitialized_memory=torch.utils.deterministic.fill_uninitialized_memory,
        cublas_workspace_config=os.environ.get(CUBLAS_WORKSPACE_ENV),
        cudnn_deterministic=torch.backends.cudnn.deterministic,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
    )


@contextlib.contextmanager
def deterministic() -> Iterator[Determinism]:
    """Apply [Note: deterministic ranks]; yields the settings in effect inside."""
    before = current()
    os.environ.setdefault(CUBLAS_WORKSPACE_ENV, CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield current()
    finally:
        torch.use_deterministic_algorithms(
            before.deterministic_algorithms, warn_only=before.warn_only
        )
        torch.utils.deterministic.fill_uninitialized_memory = before.fill_uninitialized_memory
        torch.backends.cudnn.deterministic = before.cudnn_deterministic
        torch.backends.cudnn.benchmark = before.cudnn_benchmark
        if before.cublas_workspace_config is None:
            os.environ.pop(CUBLAS_WORKSPACE_ENV, None)
