"""Skip marks for tests that need an optional extra their tox environment may not install
(``tox -e unit`` has only the ``test`` extra): each names the extra that brings it."""

from __future__ import annotations

import importlib.util

import pytest

NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the qwen3 workloads need transformers (the qualify extra: pip install 'qwz[qualify]')",
)
"""For a test that builds or plans a Qwen3 workload (the default workload is one)."""
