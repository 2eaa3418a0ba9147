"""What one rank observed of one arm: the typed seam between the ranks (run/runner.py) and
the record builder (build.py).

An ``ArmObservation`` is made on a rank, pickled to rank 0 (and to the launcher's side
channel, so a crashed run keeps the arms every rank finished) and read by ``build_record``;
the record stores its fields merged over the ranks. The nested values stay JSON-shaped
(lists and dicts), as the record stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _no_memory() -> dict[str, Any]:
    return {"kind": "rss", "peak_allocated_bytes": 0, "peak_reserved_bytes": None}


@dataclass(frozen=True)
class ArmObservation:
    """One rank's observations of one arm; the defaults are an arm before its first step (or
    one that never ran)."""

    losses: list[float] = field(default_factory=list)
    """The mean loss over the ranks after every completed step."""
    grad_norms: list[float] = field(default_factory=list)
    held_out: list[list[float]] = field(default_factory=list)
    """``[step, loss]`` at the plan's evaluation steps; ``[step, loss, batch_losses]`` under
    the non-inferiority rule (every held-out batch's loss, rank by rank)."""
    step1_digests: dict[str, str] | None = None
    """Master digests after the arm's first optimizer step, ``first_update_step``."""
    step_digests: list[dict[str, str]] = field(default_factory=list)
    """After every completed step, the short master digests ([Note: short digests],
    run/observers/digest.py)."""
    first_update_step: int | None = None
    """The first step the optimizer took: 1, unless fp16 overflows skipped the first."""
    loss_scales: list[float | None] | None = None
    """fp16: per step, the loss scale this rank applied ([Note: overflow observation],
    run/observers/overflow.py); None for other dtypes."""
    overflowed: list[bool] | None = None
    """fp16: per step, whether any rank's loss-scaled gradient held an Inf or NaN."""
    update: dict[str, Any] | None = None
    """[Note: exact update check] (run/observers/update.py), as ``UpdateResult`` fields."""
    own_shard: dict[str, Any] | None = None
    """The own-shard decode check, as ``OwnShardResult`` fields; None for calibration."""
    kernels: dict[str, Any] | None = None
    replica_divergence: dict[str, Any] | None = None
    """The first step at which the ranks' working copies differed, with the parameters."""
    drift_max_abs: list[float] = field(default_factory=list)
    gather_bytes: int = 0
    """The last step's weight-gather bytes (qwz/integrations/probe.py)."""
    final_hash: str | None = None
    final_hashes: dict[str, str] | None = None
    """Per replica key this rank holds (``dense``, ``expert<i>``), the hash of those
    parameters ([Note: replica sets], run/replicas.py)."""
    group_size: int | None = None
    """The group size the engine reports ([Note: reported group size], run/subjects.py)."""
    reported_by: str | None = None
    wire: list[dict[str, Any]] = field(default_factory=list)
    """The last step's gather bytes and calls per process group, with the group's counts, and
    the largest weight-gather collective output of any step ([Note: the staging bound],
    evidence/staging.py)."""
    uncounted: dict[str, int] = field(default_factory=dict)
    """Collective calls over all steps the probe could not attribute to a process group,
    by entry point ([Note: wire accounting below every entry point], qwz/integrations/probe.py)."""
    failure: dict[str, Any] | None = None
    steps_completed: int = 0
    memory: dict[str, Any] = field(default_factory=_no_memory)
    """The arm's peak memory ([Note: peak around the train step], run/observers/step_memory.py)."""
