"""Fixtures for the multigpu suite: reusable local process groups of 2 and 4 ranks.

``worlds.run_once(world_size, fn, *args)`` runs a rank function once per world
size and arguments for the whole session and hands every later caller the same
per-rank results, so several tests can assert properties of one trajectory.

Ranks use NCCL when ``torch.cuda.device_count()`` covers the world size and gloo
otherwise; set ``QWZ_BACKEND=gloo`` (or ``nccl``) to force one. Every call into
the ranks is bounded by ``QWZ_RANK_TIMEOUT_S`` (default 240 s): a hang becomes a
failure with the surviving ranks' tracebacks, and the next test gets fresh ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from qwz.qualify.run.launch import LocalWorld

RANK_TIMEOUT_S = float(os.environ.get("QWZ_RANK_TIMEOUT_S", "240"))


class Worlds:
    """One LocalWorld per world size, recreated when an earlier test broke it, and the
    memoised results of :meth:`run_once`."""

    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}
        self._results: dict[tuple, list[Any]] = {}

    def get(self, world_size: int) -> LocalWorld:
        world = self._worlds.get(world_size)
        if world is None or world.broken:
            world = LocalWorld(world_size, timeout_s=RANK_TIMEOUT_S)
            self._worlds[world_size] = world
        return world

    def run_once(
        self, world_size: int, fn: Callable[..., Any], *args: Any, rerun: int = 0, **kwargs: Any
    ) -> list[Any]:
        """Per-rank results of ``fn(*args, **kwargs)`` on `world_size` ranks, computed on the
        first call with these arguments and returned again on later ones. The arguments
        must be JSON data (they are the cache key); a different `rerun` runs the same call
        again, for tests that compare two runs of one configuration."""
        arguments = json.dumps([args, kwargs], sort_keys=True)
        key = (world_size, fn.__module__, fn.__qualname__, arguments, rerun)
        if key not in self._results:
            self._results[key] = self.get(world_size).run(fn, *args, **kwargs)
        return self._results[key]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def worlds():
    pool = Worlds()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def deepspeed_variants(tmp_path_factory):
    """One DeepSpeed checkout for this worker with a branch per variant
    (:func:`tests.deepspeed_checkout.every_variant`; ``main`` is stock), shared by every
    module that checks out variants, so DeepSpeed builds its op once per worker ([Note: one
    DeepSpeed checkout per worker] in tests/deepspeed_checkout.py). A test checks out its
    branch (``use_variant``) before it runs anything on it."""
    from tests.deepspeed_checkout import every_variant, make_variants

    return make_variants(tmp_path_factory.mktemp("deepspeed-variants"), every_variant())
