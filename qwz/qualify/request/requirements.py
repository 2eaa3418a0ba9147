"""What a ``run`` needs that only a finished run would otherwise find missing.

Asked when a request is resolved and checked (run_request.py, preflight.py), before any rank
starts, so a missing optional package or a bucket size that would take hours costs nothing
(exit 2), never a finished run's evidence.

[Note: optional dependencies]
``pip install qwz`` installs the engine; the harness's plots (matplotlib), its paired test
(scipy), the Qwen3 workloads (transformers) and the DeepSpeed subjects (deepspeed) come
with extras. Each is imported where it is used, deep inside a run, after every arm has
trained; so each is looked up here first (``importlib.util.find_spec``, which imports
nothing but the top-level package's finder, and returns None for a module that a test
blocks with ``sys.modules[name] = None``), and its absence is refused naming the extra to
install.

[Note: collectives per step]
``--allgather-bucket-size`` is DeepSpeed's ``allgather_bucket_size``, in
elements. The weight gather keeps two staging buffers of half the budget each, and each
holds one row per rank ([Note: staging bound], qwz/layout.py), so the unquantized
reference gathers at most ``bucket_size // (2 * world_size)`` elements of a rank's shard
per collective: a tiny bucket means one collective for every few elements (7 gives one per
element of the shard, hundreds of thousands per step for the small ``mlp``, for hours).
A run whose reference would need more than :data:`MAX_GATHER_COLLECTIVES_PER_STEP`
gather collectives per step is refused, naming the smallest bucket size that stays
within it. One rank gathers nothing, so nothing is refused there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

MAX_GATHER_COLLECTIVES_PER_STEP = 4096
"""[Note: collectives per step]: the most weight-gather collectives per step a run may
plan for its unquantized reference."""

PLOTS = ("matplotlib", "qualify", "the report's plots")
STATISTICS = ("scipy", "qualify", "the speed-up's paired test")
HORIZON_STATISTICS = ("scipy", "qualify", "the long horizon's non-inferiority bound")
TRANSFORMERS = ("transformers", "qualify", "the Qwen3 workloads")
DEEPSPEED = ("deepspeed", "deepspeed", "the DeepSpeed subjects")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent blocked, or a module with no spec
        return False


def needed(
    *, workload: str, subject: str, blocks: int, learning_rule: str = "max-gap"
) -> list[tuple[str, str, str]]:
    """(module, extra, what needs it) for every optional package this run imports."""
    from qwz.qualify.evidence.rules.speed import MIN_BLOCKS_FOR_INTERVAL

    wanted = [PLOTS]
    if blocks >= MIN_BLOCKS_FOR_INTERVAL:
        wanted.append(STATISTICS)
    elif learning_rule == "non-inferiority":
        wanted.append(HORIZON_STATISTICS)
    if workload.startswith("qwen3"):
        wanted.append(TRANSFORMERS)
    if subject != "qwz" or workload == "moe-tiny":  # moe-tiny: DeepSpeed's MoE layer
        wanted.append(DEEPSPEED)
    return wanted


def missing_packages(wanted: Iterable[tuple[str, str, str]], importable=_importable) -> list[str]:
    """One line per package of `wanted` that cannot be imported, naming the extra."""
    return [
        f"{module} is not installed ({what} need it): pip install 'qwz[{extra}]'"
        for module, extra, what in wanted
        if not importable(module)
    ]


def gather_collectives_per_step(shard_numel: int, world_size: int, bucket_size: int) -> int:
    """[Note: collectives per step]: the unquantized reference's gather collectives."""
    per_collective = max(1, bucket_size // (2 * world_size))
    return -(-shard_numel // per_collective)


def smallest_bucket_size(shard_numel: int, world_size: int) -> int:
    """The smallest ``--allgather-bucket-size`` that keeps the reference within
    :data:`MAX_GATHER_COLLECTIVES_PER_STEP` gather collectives per step."""
    per_collective = -(-shard_numel // MAX_GATHER_COLLECTIVES_PER_STEP)
    return 2 * world_size * max(1, per_collective)


def bucket_size_problems(numel: int, world_size: int, bucket_size: int) -> list[str]:
    if world_size < 2:
        return []
    shard_numel = -(-numel // world_size)
    calls = gather_collectives_per_step(shard_numel, world_size, bucket_size)
    if calls <= MAX_GATHER_COLLECTIVES_PER_STEP:
        return []
    return [
        f"--allgather-bucket-size {bucket_size}: the reference's weight gather would need about "
        f"{calls:,} collectives per step for a shard of {shard_numel:,} elements on "
        f"{world_size} ranks (at most {MAX_GATHER_COLLECTIVES_PER_STEP:,}: [Note: "
        f"collectives per step], qwz/qualify/request/requirements.py); use at least "
        f"{smallest_bucket_size(shard_numel, world_size):,}"
    ]
