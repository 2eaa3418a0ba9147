"""Fixtures for the multigpu suite: reusable local process groups of 2 and 4 ranks.

Ranks use NCCL when ``torch.cuda.device_count()`` covers the world size and gloo
otherwise; set ``QWZ_BACKEND=gloo`` (or ``nccl``) to force one. Every call into
the ranks is bounded by ``QWZ_RANK_TIMEOUT_S`` (default 240 s): a hang becomes a
failure with the surviving ranks' tracebacks, and the next test gets fresh ranks.
"""

from __future__ import annotations

import os

import pytest

from qwz.launch import LocalWorld

RANK_TIMEOUT_S = float(os.environ.get("QWZ_RANK_TIMEOUT_S", "240"))


class Worlds:
    """One LocalWorld per world size, recreated when an earlier test broke it."""

    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def get(self, world_size: int) -> LocalWorld:
        world = self._worlds.get(world_size)
        if world is None or world.broken:
            world = LocalWorld(world_size, timeout_s=RANK_TIMEOUT_S)
            self._worlds[world_size] = world
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def worlds():
    pool = Worlds()
    yield pool
    pool.close()


def pytest_collection_modifyitems(items):
    # Under `pytest -n N --dist loadgroup`, keep each multigpu file on one xdist worker so its
    # ranks are spawned once, while different files (and the unit suite) run in parallel.
    for item in items:
        if item.get_closest_marker("multigpu") is not None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
