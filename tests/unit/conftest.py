"""Unit tests run without a process group; pytest-xdist already runs one worker per core."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """torch's intra-op threads on top of one xdist worker per core oversubscribe the
    cores (see test_quant.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
