"""The checks and the verdict, derived from a record's raw observations alone.

``derive(record)`` is a pure function of what a record stores; ``evidence``
calls it to write a record and ``record.load`` calls it again on every load, so
a stored check that does not follow from the stored data makes the record
invalid. Each check has a status: ``pass``, ``fail``, ``n/a`` (nothing to test,
with the reason) or ``inconclusive``; see ``seal.verdict_of``.

Which checks decide, and why (DESIGN.md, "What makes a verdict trustworthy"):
exactness where it exists -- the step-1 masters, every step's update, the own
shard's decode, the small parameters, the replicas -- and learning. The drift
of sampled parameters from the reference is context: its bound holds for any
two AdamW trajectories, so it cannot tell a learning candidate from a broken
one.

[Note: learning margin]
Quantized weights change the forward pass, so a correct candidate's held-out
loss differs from the reference's; the question is by how much a *correct*
one may. The ``calibration`` arm answers it on the same run: the unquantized
reference, with uniform noise in [-scale/2, scale/2] (each group's own scale,
at the largest candidate group size) added to the working weights after every
step -- the size and shape of the quantization error, but random, while the
master stays exact, as in a candidate. Its held-out losses differ from the
reference's by ``noise_gap`` (the largest absolute difference over the
evaluation steps after step 0): how far quantization-sized perturbations move
this workload's held-out loss. A candidate passes when, at every evaluation
step after step 0::

    held_out[candidate] - held_out[reference]
        <= margin = max(MARGIN_FACTOR * noise_gap, MARGIN_FLOOR * reference_drop)

``reference_drop`` is how much the reference's held-out loss fell from step 0
to the last evaluation. The factor allows for the noise being one draw; the
floor (a small share of what the reference learned) keeps a lucky, tiny
``noise_gap`` from failing a correct candidate. A broken candidate (no update,
ascent, a lost shard) does not learn, or un-learns: its gap is a large share
of ``reference_drop``. Under the long preset (``Learning.rule`` "non-inferiority") the
candidates are judged by [Note: non-inferiority over the horizon] (horizon.py) instead;
the reference's own check is the same. If the reference's held-out loss did not fall by at
least ``MIN_REFERENCE_DROP`` of its start, the run cannot tell learning from
not learning: ``learning[reference]`` is inconclusive, and so is the verdict.

[Note: group size from the wire]
``probe`` judges the group size from the bytes each rank sent in its weight gather
over each process group (qwz/integrations/probe.py counts them per group), by the spec's wire:
every quantized element is one int8 code, every group of G elements one fp32 scale
(``1 + 4/G`` bytes per quantized element), and the exact elements (those of parameters of
at most 65,536) travel in the working dtype. With ``q`` quantized, ``e`` exact and ``p``
padding elements in a rank's shard over the group, and ``c`` gather calls, the bytes
must lie in ``[q + 4*ceil(q/G) + e*b, n + c*(G-1) + 4*(ceil(n/G) + c - 1) + (e+p)*b +
3c]`` (``n = q + e + p``, ``b`` the working element size): the fewest is the spec's
encoding; the most allows an implementation to send codes for every shard position,
pad each call to whole groups and send the padding exactly. A gather's rows have one
size on every rank of its group, so each bound is the largest over the group's ranks.
The detail shows the G the bytes imply (``4q`` over the bytes beyond codes and exact
elements). A group size the subject reports ([Note: reported group size],
qualify/run/subjects.py) is shown and must equal the requested one; it never stands in for
the wire.

[Note: received bytes per process group]
A record whose wire holds received bytes (qwz/integrations/probe.py counts them below every entry
point) is judged by what each rank *received* from its peers over each process group, so
the collective is free: an all-gather into one tensor or a list, one broadcast per source,
point-to-point, an all-to-all all deliver each peer's row once. Source ``r``'s row over the
step, in ``c`` chunks (the rank's peer rows over ``W - 1``), takes at least the spec's
encoding ``q_r + 4*ceil(q_r/G) + e_r*b`` and at most ``n_r + c*(G-1) + 4*(ceil(n_r/G) + c -
1) + min(n_r, X)*max(b, 4) + c*ROW_SLACK_BYTES``, ``X`` the exact and padding elements of
all the group's ranks: codes for every position padded per chunk to whole groups, and exact
elements as fp32, per chunk padded to the rank with the most there (the per-chunk maxima
sum to at most ``X``). A rank receives at least its peers' fewest summed and at most
``W - 1`` rows of the largest most (rows padded to the fullest rank). Unquantized bf16
(``2*n_r`` a row) lies above that unless it comes in nearly a chunk per group (the ``c*(G-1)``
term), and ``in-effect`` fails it however it is chunked; fewer bytes than the codes and
scales lie below it.
``in-effect`` then compares each rank's received bytes over each group with the
reference's on the same rank and group. Calls the probe could not attribute make both
inconclusive.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from typing import Any

from qwz.qualify.evidence import (
    bounded,
    conformance,
    gather_speed,
    horizon,
    loss_scaling,
    optimizer,
    schemes,
    stats,
)
from qwz.qualify.evidence.rules import SPEED, rule
from qwz.qualify.evidence.schema import Check, Probe, Record, WireGroup
from qwz.qualify.evidence.spec import SCALE_BYTES

MIN_REFERENCE_DROP = 0.02
"""The reference's held-out loss must fall by this fraction of its start to be a baseline."""
MARGIN_FACTOR = 3.0
MARGIN_FLOOR = 0.01
"""Share of the reference's held-out improvement a correct candidate may always lose."""
ONE_RANK = (
    "one rank: nothing was quantized or sent (the weight gather is a local copy), so "
    "the quantized gather was not tested; run with --world-size 2 or more"
)
"""[Note: one rank] (DESIGN.md: "one rank is INCONCLUSIVE"): with one rank the candidate
arms run no quantized gather at all, so every check of them passes vacuously; each
candidate's ``in-effect`` is inconclusive, and so is the verdict."""
MIN_BLOCKS_FOR_INTERVAL = 4
"""Fewer blocks give no interval: a percentile bootstrap of the median of n < 4 values can
only return the sample's own extremes, a width that says nothing about noise."""


def _check(name: str, status: str, detail: str, **numbers: Any) -> Check:
    return Check(name=name, status=status, detail=detail, numbers=numbers)


def _where(violation) -> str:
    index = f"[{violation.index}]" if violation.index >= 0 else ""
    return f"step {violation.step}, rank {violation.rank}, {violation.parameter}{index}"


def _held_out(record: Record) -> dict[str, dict[int, float | None]]:
    return {t.arm: {h.step: h.loss for h in t.held_out} for t in record.trajectories}


def _failures(record: Record) -> dict[str, Any]:
    return {t.arm: t.failure for t in record.trajectories}


def derive(record: Record) -> list[Check]:
    """Every check, recomputed from the record's observations (module docstring), in the
    order the record stores them."""
    arms = {arm.name: arm for arm in record.arms}
    reference = next((arm.name for arm in record.arms if arm.role == "reference"), None)
    candidates = [arm for arm in record.arms if arm.role == "candidate"]
    failures = _failures(record)
    world_size = record.environment.world_size
    digests = {item.arm: item for item in record.step_one}
    skips = _skips(record)
    checks = [_finite(trajectory, skips.get(trajectory.arm)) for trajectory in record.trajectories]
    checks += [_step_one(arm.name, digests, reference) for arm in candidates]
    checks += [
        _update(updates, skips.get(updates.arm), arms[updates.arm].config)
        for updates in record.updates
    ]
    checks += _overflow_patterns(record, reference)
    run_scheme = schemes.run_scheme(record)
    checks += [
        schemes.own_shard(own, arms[own.arm].quantized, failures.get(own.arm), run_scheme)
        for own in record.own_shards
    ]
    for hashes in record.hashes:
        checks += [_replicas(hashes, world_size), _reproduced(hashes)]
    for probe in record.probes:
        checks.append(_probe(probe, world_size, failures.get(probe.arm)))
        checks.append(_in_effect(probe, world_size, failures.get(probe.arm)))
    checks += bounded.bounded_checks(record)
    checks += _learning(record, reference, candidates)
    if record.plan.min_speedup is not None:
        checks += [_speedup(item, record.plan.min_speedup) for item in record.performance]
    checks.append(conformance.conformance(record))
    return checks


def _skips(record: Record) -> dict[str, loss_scaling.Skips]:
    """fp16: every arm's skips against its overflows ([Note: overflow pattern])."""
    updates = {item.arm: item for item in record.updates}
    world_size = record.environment.world_size
    return {
        trace.arm: loss_scaling.skips(trace, updates[trace.arm], world_size)
        for trace in record.loss_scaling
        if trace.arm in updates
    }


@rule("overflow-pattern", 1)
def _overflow_patterns(record: Record, reference: str | None) -> list[Check]:
    """``overflow-pattern[arm]`` for every fp16 arm (loss_scaling.py)."""
    traces = {trace.arm: trace for trace in record.loss_scaling}
    first = {item.arm: item.step for item in record.step_one}
    configs = {arm.name: arm.config.get("fp16", {}) for arm in record.arms}
    roles = {arm.name: arm.role for arm in record.arms}
    base = traces.get(reference or "")
    return [
        loss_scaling.overflow_pattern(
            trace,
            configs[trace.arm],
            first.get(trace.arm),
            (base, first.get(reference)) if base and roles[trace.arm] == "candidate" else None,
        )
        for trace in record.loss_scaling
    ]


@rule("finite", 1)
def _finite(trajectory, skips: loss_scaling.Skips | None = None) -> Check:
    """Every arm ran to the end with finite numbers (fp16: except on legitimately skipped
    steps, [Note: overflow pattern])."""
    failure, name = trajectory.failure, f"finite[{trajectory.arm}]"
    allowed = skips.legitimate if skips is not None else frozenset()
    numbers = [
        value
        for series in (trajectory.losses, trajectory.grad_norms)
        for step, value in enumerate(series, 1)
        if step not in allowed
    ]
    if failure is not None and failure.kind == "not-run":
        return _check(name, "n/a", failure.message)
    if failure is not None:
        params = f" (non-finite: {', '.join(failure.parameters)})" if failure.parameters else ""
        return _check(
            name,
            "fail",
            f"{failure.kind} at step {failure.step} on rank {failure.rank}: "
            f"{failure.message}{params}",
            step=failure.step,
            rank=failure.rank,
        )
    if len(trajectory.losses) != trajectory.steps_planned or None in numbers:
        return _check(
            name,
            "fail",
            f"{len(trajectory.losses)} of {trajectory.steps_planned} steps recorded, "
            f"{sum(value is None for value in numbers)} non-finite values",
        )
    skipped = (
        f" but on {len(allowed)} overflow-skipped steps (the loss scaler's business)"
        if allowed
        else ""
    )
    return _check(
        name,
        "pass",
        f"{trajectory.steps_planned} steps, every loss and gradient norm finite{skipped}",
        steps=trajectory.steps_planned,
        overflow_skipped=len(allowed),
    )


@rule("step1-exact", 1)
def _step_one(arm: str, digests: dict[str, Any], reference: str | None) -> Check:
    """Step 1 (the first optimizer step: later where fp16 overflows skipped the first): a
    candidate's masters equal the reference's, bit for bit."""
    name = f"step1-exact[{arm}]"
    their_item, our_item = digests.get(reference or ""), digests.get(arm)
    theirs = their_item.digests if their_item else None
    ours = our_item.digests if our_item else None
    if theirs is None or ours is None:
        who = arm if ours is None else "the reference"
        return _check(name, "n/a", f"{who} did not complete step 1")
    if our_item.step != their_item.step:
        return _check(
            name,
            "fail",
            f"the first optimizer step was step {our_item.step}, the reference's step "
            f"{their_item.step}: with the same weights and batches until then, they differ",
        )
    differing = sorted(key for key in theirs if ours.get(key) != theirs[key])
    differing += sorted(set(ours) - set(theirs))
    if differing:
        return _check(
            name,
            "fail",
            f"after step 1 the fp32 masters of {len(differing)} of {len(theirs)} "
            f"parameters differ from the reference's: {', '.join(differing[:8])}"
            + (" ..." if len(differing) > 8 else ""),
            differing=len(differing),
        )
    at = "step 1" if our_item.step in (None, 1) else f"the first optimizer step ({our_item.step})"
    return _check(
        name,
        "pass",
        f"after {at} all {len(theirs)} parameters' fp32 masters equal the "
        "reference's bit for bit (same start, same first gradient)",
        parameters=len(theirs),
    )


def arm_final_hash(per_rank: list[str | None], set_hashes: list[list[str | None]]) -> str | None:
    """The arm's final hash (what the ledger keys on and ``reproduced`` shows): every rank's
    hash when they agree; with experts ([Note: replica sets], qualify/run/replicas.py, more
    than one set), the sha256 of every set's agreed hash; None where a set disagrees or a
    hash is missing."""
    if len(set_hashes) <= 1:
        if not per_rank or None in per_rank or len(set(per_rank)) != 1:
            return None
        return per_rank[0]
    if any(None in hashes or len(set(hashes)) != 1 for hashes in set_hashes):
        return None
    joined = "\n".join(hashes[0] for hashes in set_hashes)
    return hashlib.sha256(joined.encode()).hexdigest()


@rule("replicas", 1)
def _replicas(hashes, world_size: int) -> Check:
    """Replicas identical after every step and at the end, each parameter over the ranks
    that hold it ([Note: replica sets])."""
    name = f"replicas[{hashes.arm}]"
    if world_size == 1:
        return _check(name, "n/a", "one rank: there are no replicas to compare")
    if hashes.divergence is not None:
        return _check(
            name,
            "fail",
            f"ranks' working copies differ after step {hashes.divergence.step} in "
            + ", ".join(hashes.divergence.parameters[:8]),
            step=hashes.divergence.step,
        )
    sets = [(item.params, item.ranks, item.hashes) for item in hashes.replica_sets]
    if not sets:  # a record written before replica sets: every rank holds everything
        sets = [("dense", list(range(len(hashes.per_rank))), hashes.per_rank)]
    if any(None in values for _, _, values in sets):
        return _check(name, "n/a", "the arm failed before its final hash")
    disagree = [
        f"{params} over ranks {ranks}: " + ", ".join(str(h)[:16] for h in values)
        for params, ranks, values in sets
        if len(set(values)) != 1
    ]
    if disagree:
        return _check(name, "fail", "ranks' final hashes disagree: " + "; ".join(disagree[:4]))
    if len(sets) == 1:
        return _check(
            name,
            "pass",
            f"working copies identical on all {len(sets[0][1])} ranks after every "
            f"step; final hash {str(sets[0][2][0])[:16]}",
        )
    return _check(
        name,
        "pass",
        "working copies identical after every step within every replica set ("
        + "; ".join(f"{params}: ranks {ranks}" for params, ranks, _ in sets[:6])
        + (" ..." if len(sets) > 6 else "")
        + f"); final hash {str(arm_final_hash(hashes.per_rank, [s[2] for s in sets]))[:16]}",
        sets=len(sets),
    )


@rule("speedup", 1)
def _speedup(performance, min_speedup: float) -> Check:
    """An explicit speed requirement, when the run was given one."""
    name = f"speedup[{performance.arm}]"
    if performance.interval != "bootstrap" or performance.ci_low is None:
        return _check(
            name,
            "n/a",
            f"insufficient blocks: {len(performance.blocks)} < "
            f"{MIN_BLOCKS_FOR_INTERVAL}, no interval to hold to {min_speedup}",
        )
    return _check(
        name,
        "pass" if performance.ci_low >= min_speedup else "fail",
        f"median {performance.median_speedup:.4f}x, 95% interval "
        f"[{performance.ci_low:.4f}, {performance.ci_high:.4f}]; required lower "
        f"end >= {min_speedup}",
        median=performance.median_speedup,
        ci_low=performance.ci_low,
    )


def _skip_problems(skips: loss_scaling.Skips | None) -> str:
    """fp16: the steps skipped or taken against the overflows ([Note: overflow pattern])."""
    if skips is None:
        return ""
    wrong = [
        f"rank {rank} did not step at step {step}, though no rank's gradient overflowed"
        for step, rank in skips.unwarranted
    ] + [
        f"rank {rank} stepped at step {step}, though a rank's fp16 gradient overflowed"
        for step, rank in skips.stepped_on_overflow
    ]
    return "; ".join(wrong[:4]) + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")


@rule("update", 2)
def _update(updates, skips: loss_scaling.Skips | None = None, config=None) -> Check:
    """[Note: exact update check] and [Note: global norm check] (qualify/run/observers/update.py);
    fp16: the skips against the overflows ([Note: overflow pattern]); n/a for an arm whose
    config's optimizer is not re-derived ([Note: the optimizer the update check re-derives],
    qualify/evidence/optimizer.py), unless its steps or its handed norm failed."""
    name = f"update[{updates.arm}]"
    wrong_skips = _skip_problems(skips)
    if wrong_skips:
        return _check(name, "fail", f"fp16 skips: {wrong_skips}", violations=updates.violations)
    norm = (
        f"; the handed gradient's global norm matched min(norm, clip) on "
        f"{updates.norm_checked} steps (worst {updates.norm_max_ratio:.3g} of the bound)"
    )
    not_derived = optimizer.adamw_of(config or {})
    if isinstance(not_derived, str) and not (updates.missing_steps or updates.norm_violations):
        detail = f"{not_derived}: the update is not re-derived (AdamW only)"
        return _check(name, "n/a", detail + (norm if updates.norm_checked else ""))
    if updates.checked == 0 and not (updates.missing_steps or updates.norm_violations):
        return _check(name, "n/a", "no optimizer step was observed")
    if updates.violations or updates.missing_steps or updates.norm_violations:
        first = updates.first_violation
        where = f"first at {_where(first)}: {first.what}" if first else ""
        norms = (
            f"; the global norm of the gradient the optimizer was handed was wrong on "
            f"{updates.norm_violations} of {updates.norm_checked} steps"
            if updates.norm_violations
            else ""
        )
        return _check(
            name,
            "fail",
            f"{updates.violations} of {updates.checked} sampled master updates differ "
            f"from AdamW's on the arm's own gradient and state{norms}; {where}",
            violations=updates.violations,
            norm_violations=updates.norm_violations,
            step=first.step if first else None,
        )
    return _check(
        name,
        "pass",
        f"{updates.checked} sampled master updates"
        + (f" of {updates.optimizer}" if updates.optimizer else "")
        + " equal AdamW's on the arm's own "
        f"gradient and state within rounding (worst {updates.max_ratio:.3g} of "
        f"the bound){norm if updates.norm_checked else ''}; "
        + (
            f"one optimizer step per training step on every rank but on the "
            f"{len(skips.legitimate)} overflowed steps, which every rank skipped with its "
            "sampled masters unchanged"
            if skips is not None and skips.legitimate
            else "one optimizer step per training step on every rank"
        ),
        checked=updates.checked,
        max_ratio=updates.max_ratio,
        norm_checked=updates.norm_checked,
        norm_max_ratio=updates.norm_max_ratio,
    )


ALIGNMENT_BYTES = 3
"""Padding a gather call's row may add to keep the next row's scales aligned."""


def wire_bounds(group: WireGroup, group_size: int) -> tuple[int, int]:
    """[Note: group size from the wire]: the fewest and the most bytes a rank may send per
    step over one process group when its quantized elements travel in groups of
    `group_size`."""
    quantized, exact = group.quantized_numel, group.exact_numel
    numel = quantized + exact + group.padding_numel
    calls = max(1, group.calls_per_step)
    fewest = quantized + SCALE_BYTES * -(-quantized // group_size) + exact * group.element_bytes
    most = (
        numel
        + calls * (group_size - 1)
        + SCALE_BYTES * (-(-numel // group_size) + calls - 1)
        + (exact + group.padding_numel) * group.element_bytes
        + calls * ALIGNMENT_BYTES
    )
    return fewest, most


def group_bounds(groups: list[WireGroup], group: WireGroup, group_size: int) -> tuple[int, int]:
    """:func:`wire_bounds` for `group` given every rank's entry in `groups`: a gather sends
    rows of one size on every rank of the process group, so each rank's row is sized for
    the rank with the most to send -- the largest of the ranks' fewest and most bytes."""
    peers = [item for item in groups if item.group_ranks == group.group_ranks] or [group]
    bounds = [wire_bounds(item, group_size) for item in peers]
    return max(fewest for fewest, _ in bounds), max(most for _, most in bounds)


def wire_group_size(groups: list[WireGroup], group: WireGroup) -> float | None:
    """The group size `group`'s bytes imply by the spec's ``1 + 4/G`` bytes per quantized
    element -- every byte beyond the codes and the exact elements taken for scales -- with
    the counts of the fullest rank of its process group in `groups` (the one its row is
    sized for); None where they leave nothing for scales (an unquantized wire)."""
    peers = [item for item in groups if item.group_ranks == group.group_ranks] or [group]
    fullest = max(peers, key=lambda item: wire_bounds(item, 1 << 30)[0])
    exact_bytes = (fullest.exact_numel + fullest.padding_numel) * fullest.element_bytes
    overhead = group.bytes_per_step - fullest.quantized_numel - exact_bytes
    if fullest.quantized_numel == 0 or overhead <= 0:
        return None
    return SCALE_BYTES * fullest.quantized_numel / overhead


EXACT_SIDE_CHANNEL_BYTES = 4
"""[Note: received bytes per process group]: the most bytes one exact element may take on the
wire (sent as fp32; the fewest is the working dtype's). The name is older than the one name
"exact elements" and stays: it is part of the probe rule's constants digest (judge.py), which
a rename would change without a rule change."""
ROW_SLACK_BYTES = 48
"""[Note: received bytes per process group]: padding one source's row per chunk may carry --
each of its three parts (codes, scales, exact elements) aligned to 16 bytes."""


def received_rule(probe: Probe) -> bool:
    """Whether `probe` was recorded with received bytes ([Note: received bytes per process
    group]); an older record is judged by the bytes sent ([Note: group size from the
    wire])."""
    return bool(probe.wire) and all(
        group.received_bytes_per_step is not None for group in probe.wire
    )


def _peers(groups: list[WireGroup], group: WireGroup) -> list[WireGroup]:
    return [item for item in groups if item.group_ranks == group.group_ranks] or [group]


def source_row_bounds(
    source: WireGroup, peers: list[WireGroup], group_size: int, chunks: int
) -> tuple[int, int]:
    """[Note: received bytes per process group]: the fewest and the most bytes of what
    `source` sends its peers per step in `chunks` chunks."""
    quantized, exact = source.quantized_numel, source.exact_numel
    numel = quantized + exact + source.padding_numel
    chunks = max(1, chunks)
    fewest = quantized + SCALE_BYTES * -(-quantized // group_size) + exact * source.element_bytes
    exact_anywhere = sum(item.exact_numel + item.padding_numel for item in peers)
    most = (
        numel
        + chunks * (group_size - 1)
        + SCALE_BYTES * (-(-numel // group_size) + chunks - 1)
        + min(numel, exact_anywhere) * max(source.element_bytes, EXACT_SIDE_CHANNEL_BYTES)
        + chunks * ROW_SLACK_BYTES
    )
    return fewest, most


def received_bounds(groups: list[WireGroup], group: WireGroup, group_size: int) -> tuple[int, int]:
    """[Note: received bytes per process group]: the fewest and the most bytes `group`'s
    rank may receive from its peers per step, given every rank's entry in `groups`."""
    peers = _peers(groups, group)
    others = [item for item in peers if item.rank != group.rank]
    world = len(group.group_ranks)
    chunks = -(-(group.rows_per_step or 0) // max(1, world - 1))
    bounds = [source_row_bounds(item, peers, group_size, chunks) for item in peers]
    fewest = sum(source_row_bounds(item, peers, group_size, chunks)[0] for item in others)
    missing = max(0, world - 1 - len(others))  # a rank whose entry is absent: its least
    fewest += missing * min(low for low, _ in bounds)
    return fewest, (world - 1) * max(most for _, most in bounds)


def received_group_size(groups: list[WireGroup], group: WireGroup) -> float | None:
    """The group size `group`'s received bytes imply by ``1 + 4/G`` bytes per quantized
    element, every byte beyond the peers' codes and exact elements taken for scales; None
    where they leave nothing for scales (an unquantized wire)."""
    others = [item for item in _peers(groups, group) if item.rank != group.rank]
    quantized = sum(item.quantized_numel for item in others)
    exact_bytes = sum(
        (item.exact_numel + item.padding_numel) * item.element_bytes for item in others
    )
    overhead = (group.received_bytes_per_step or 0) - quantized - exact_bytes
    if quantized == 0 or overhead <= 0:
        return None
    return SCALE_BYTES * quantized / overhead


def _uncounted(probe: Probe, name: str) -> Check | None:
    """[Note: wire accounting below every entry point] (qwz/integrations/probe.py): an account with
    calls it could not attribute is incomplete, so neither a pass nor a fail follows from it."""
    if probe.uncounted_calls == 0:
        return None
    where = ", ".join(probe.uncounted[:6]) or "unnamed entry points"
    return _check(
        name,
        "inconclusive",
        f"{probe.uncounted_calls} collective calls could not be attributed to a process "
        f"group ({where}): the wire's account is incomplete",
        uncounted_calls=probe.uncounted_calls,
    )


@rule("probe", 2)
def _probe(probe: Probe, world_size: int, failure: Any) -> Check:
    """[Note: group size from the wire]; [Note: received bytes per process group]."""
    name = f"probe[{probe.arm}]"
    requested = probe.requested_group_size
    reported = probe.reported_group_sizes
    sources = sorted({source for source in probe.reported_by if source})
    said = f"; the subject reports {reported}" + (f" ({', '.join(sources)})" if sources else "")
    if world_size == 1:
        # One rank gathers exactly (nothing to save on the wire), so no group size is used:
        # nothing to test unless the subject claims one ([Note: one rank], below).
        wrong = [size for size in reported if size is not None]
        status = "fail" if wrong else "n/a"
        return _check(name, status, f"one rank: the gather is exact{said}", reported=reported)
    incomplete = _uncounted(probe, name)
    if incomplete is not None:
        return incomplete
    measured = _measured(probe)
    if not measured and failure is not None:
        return _check(name, "n/a", "the arm failed before a gather was measured")
    if not measured:
        return _check(name, "fail", f"no quantized elements on the wire were measured{said}")
    if received_rule(probe):
        return _probe_received(probe, measured, name, said)
    lines, outside = [], []
    for group in measured:
        fewest, most = group_bounds(probe.wire, group, requested)
        implied = wire_group_size(probe.wire, group)
        where = f"rank {group.rank} over ranks {group.group_ranks}"
        lines.append(
            f"{where}: {group.bytes_per_step:,} B for {group.quantized_numel:,} quantized + "
            f"{group.exact_numel:,} exact elements, G ~ "
            + ("none (no bytes for scales)" if implied is None else f"{implied:.0f}")
        )
        if not fewest <= group.bytes_per_step <= most:
            outside.append(f"{where}: {group.bytes_per_step:,} B outside [{fewest:,}, {most:,}]")
    fits = f"the wire's bytes fit groups of {requested} on every rank"
    sizes = [wire_group_size(probe.wire, group) for group in measured]
    return _probe_verdict(probe, name, said, lines, outside, fits, sizes)


def _measured(probe: Probe) -> list[WireGroup]:
    return [
        group for group in probe.wire if group.quantized_numel > 0 and len(group.group_ranks) > 1
    ]


def _probe_received(probe: Probe, measured: list[WireGroup], name: str, said: str) -> Check:
    """[Note: received bytes per process group]."""
    requested = probe.requested_group_size
    lines, outside = [], []
    for group in measured:
        fewest, most = received_bounds(probe.wire, group, requested)
        implied = received_group_size(probe.wire, group)
        received = group.received_bytes_per_step or 0
        where = f"rank {group.rank} over ranks {group.group_ranks}"
        lines.append(
            f"{where}: received {received:,} B in {group.rows_per_step or 0} peer rows, G ~ "
            + ("none (no bytes for scales)" if implied is None else f"{implied:.0f}")
        )
        if not fewest <= received <= most:
            outside.append(f"{where}: received {received:,} B outside [{fewest:,}, {most:,}]")
    fits = f"the bytes each rank received fit groups of {requested}"
    sizes = [received_group_size(probe.wire, group) for group in measured]
    return _probe_verdict(probe, name, said, lines, outside, fits, sizes)


def _probe_verdict(
    probe: Probe,
    name: str,
    said: str,
    lines: list[str],
    outside: list[str],
    fits: str,
    sizes: list[float | None],
) -> Check:
    """``probe``'s check from the bounds each measured group was held to (both rules)."""
    requested, reported = probe.requested_group_size, probe.reported_group_sizes
    disagree = [size for size in reported if size is not None and size != requested]
    status = "fail" if outside or disagree else "pass"
    if outside:
        verdict = f"the wire does not carry groups of {requested}: {'; '.join(outside)}"
    elif disagree:
        verdict = f"the subject reports {disagree[0]}, not the requested {requested}"
    else:
        verdict = fits
    # A one-rank group (experts whose expert-data-parallel group is one rank) sends nothing:
    # its gather is a local copy, exact by the spec (own-shard holds it to that).
    local = sorted(
        {tuple(group.group_ranks) for group in probe.wire if len(group.group_ranks) == 1}
    )
    if local:
        said += (
            f"; one-rank groups {', '.join(map(str, map(list, local)))}: a local copy, not judged"
        )
    return _check(
        name,
        status,
        f"requested group size {requested}: {verdict} ({'; '.join(lines[:4])}){said}",
        requested=requested,
        reported=reported,
        wire_group_sizes=sizes,
    )


def _in_effect_received(probe: Probe, failure: Any, name: str) -> Check:
    """[Note: received bytes per process group]: on every rank and process group the
    candidate's gather receives fewer bytes than the reference's on the same."""
    reference = {(item.rank, tuple(item.group_ranks)): item for item in probe.reference_wire}
    measured = _measured(probe)
    if not measured and failure is not None:
        return _check(name, "n/a", "the arm failed before a gather was measured")
    pairs, unmatched = [], []
    for group in measured:
        key = (group.rank, tuple(group.group_ranks))
        if key in reference and reference[key].received_bytes_per_step is not None:
            pairs.append((group, reference[key].received_bytes_per_step))
        else:
            unmatched.append(f"rank {group.rank} over ranks {group.group_ranks}")
    if unmatched:  # the arms disagree on their process groups: nothing to compare with
        return _check(
            name, "inconclusive", f"no reference gather to compare with for {', '.join(unmatched)}"
        )
    received = sum(group.received_bytes_per_step or 0 for group, _ in pairs)
    reference_total = sum(bytes_ for _, bytes_ in pairs)
    numbers = {"received_bytes": received, "reference_received_bytes": reference_total}
    short = [
        f"rank {group.rank} over ranks {group.group_ranks}: {group.received_bytes_per_step:,} B "
        f"vs {bytes_:,} B unquantized"
        for group, bytes_ in pairs
        if not 0 < (group.received_bytes_per_step or 0) < bytes_
    ]
    if pairs and not short:
        return _check(
            name,
            "pass",
            f"on every rank and process group the weight gather receives fewer bytes than the "
            f"unquantized reference's: {received:,} B per step vs {reference_total:,} B "
            f"({received / reference_total:.4f}x)",
            **numbers,
        )
    return _check(
        name,
        "fail",
        "quantized weights requested but not in effect: "
        + ("; ".join(short[:4]) if short else "no quantized elements on the wire were measured"),
        **numbers,
    )


@rule("in-effect", 2)
def _in_effect(probe: Probe, world_size: int, failure: Any) -> Check:
    """Quantized weights requested and in effect: the candidate's weight gather sends fewer
    bytes than the unquantized reference's."""
    sent, reference_bytes = probe.gather_bytes_per_step, probe.reference_gather_bytes_per_step
    name = f"in-effect[{probe.arm}]"
    if world_size == 1:
        return _check(name, "inconclusive", ONE_RANK)
    incomplete = _uncounted(probe, name)
    if incomplete is not None:
        return incomplete
    if received_rule(probe) and probe.reference_wire:
        return _in_effect_received(probe, failure, name)
    if failure is not None and sent == 0:
        return _check(name, "n/a", "the arm failed before a gather was measured")
    if 0 < sent < reference_bytes:
        return _check(
            name,
            "pass",
            f"weight gather sends {sent} bytes per step vs {reference_bytes} "
            f"unquantized ({sent / reference_bytes:.4f}x)",
            bytes=sent,
            reference_bytes=reference_bytes,
        )
    return _check(
        name,
        "fail",
        "quantized weights requested but not in effect: the weight gather sent "
        f"{sent} bytes per step, the unquantized reference {reference_bytes}",
        bytes=sent,
        reference_bytes=reference_bytes,
    )


@rule("reproduced", 1)
def _reproduced(hashes) -> Check:
    name = f"reproduced[{hashes.arm}]"
    this = arm_final_hash(hashes.per_rank, [item.hashes for item in hashes.replica_sets])
    others = "".join(
        f"; {'same hash as' if other == this else 'differs from'} the {description} arm's "
        f"{other[:16]}"
        for description, other in hashes.ledger_siblings.items()
    )
    if hashes.ledger_status == "not-checked":
        return _check(name, "n/a", "no ledger given (--ledger), or the replicas disagree")
    if hashes.ledger_status == "recorded":
        return _check(
            name, "n/a", "first run of this head, environment and arm: hash recorded" + others
        )
    if hashes.ledger_status == "reproduced":
        return _check(
            name, "pass", f"reproduced the ledger's hash {str(this)[:16]}{others}", this_run=this
        )
    return _check(
        name,
        "fail",
        f"MISMATCH: this run {str(this)[:16]}, ledger {str(hashes.ledger_previous)[:16]} for "
        f"the same head and environment{others}",
        this_run=this,
        ledger=hashes.ledger_previous,
    )


def learning_margin(record: Record) -> dict[str, Any]:
    """The numbers of [Note: learning margin] for this record (floats may be None)."""
    held_out = _held_out(record)
    reference = next((arm.name for arm in record.arms if arm.role == "reference"), None)
    ref = held_out.get(reference or "", {})
    steps = [step for step in record.learning.eval_steps if step > 0]
    start, last = ref.get(0), ref.get(max(steps)) if steps else None
    drop = None if start is None or last is None else start - last
    calibration = held_out.get(record.learning.calibration_arm or "", {})
    gaps = [
        abs(calibration[step] - ref[step])
        for step in steps
        if calibration.get(step) is not None and ref.get(step) is not None
    ]
    noise_gap = max(gaps) if len(gaps) == len(steps) and steps else None
    margin = None
    if drop is not None and drop > 0:
        margin = MARGIN_FLOOR * drop
        if noise_gap is not None:
            margin = max(margin, MARGIN_FACTOR * noise_gap)
    return {
        "reference_start": start,
        "reference_last": last,
        "reference_drop": drop,
        "noise_gap": noise_gap,
        "margin": margin,
        "margin_factor": MARGIN_FACTOR,
        "margin_floor": MARGIN_FLOOR,
        "min_reference_drop": MIN_REFERENCE_DROP,
    }


@rule("learning", 1)
def _learning(record: Record, reference: str | None, candidates) -> list[Check]:
    numbers = learning_margin(record)
    reference_check = _reference_learning(reference, numbers)
    learned = reference_check.status == "pass"
    held_out = _held_out(record)
    steps = [step for step in record.learning.eval_steps if step > 0]
    # A run that crashed or never started an arm left it no held-out losses: finite says why.
    ended = {t.arm: t.failure.kind for t in record.trajectories if t.failure is not None}
    checks = [reference_check]
    for arm in candidates:
        name = f"learning[{arm.name}]"
        if ended.get(arm.name) in ("crash", "not-run"):
            checks.append(_check(name, "n/a", f"the arm ended: {ended[arm.name]}; see finite"))
        elif not learned or numbers["margin"] is None:
            undecided = "inconclusive" if numbers["reference_drop"] is not None else "n/a"
            checks.append(_check(name, undecided, "see the reference"))
        elif record.learning.rule == "non-inferiority":
            checks.append(_horizon(record, arm.name, reference))
        else:
            ours, theirs = held_out.get(arm.name, {}), held_out[reference]
            checks.append(_max_gap(name, ours, theirs, steps, numbers))
    return checks


def _reference_learning(reference: str | None, numbers: dict[str, Any]) -> Check:
    """``learning[reference]``: its held-out loss fell enough to be a baseline."""
    name = f"learning[{reference}]"
    start, drop = numbers["reference_start"], numbers["reference_drop"]
    if drop is None or start is None:
        return _check(name, "n/a", "the reference has no held-out losses to compare")
    if drop >= MIN_REFERENCE_DROP * abs(start):
        return _check(
            name,
            "pass",
            f"held-out loss fell {start:.4f} -> {numbers['reference_last']:.4f} "
            f"(>= {MIN_REFERENCE_DROP:.0%} of its start)",
            **numbers,
        )
    return _check(
        name,
        "inconclusive",
        f"the reference did not learn: held-out loss {start:.4f} -> "
        f"{numbers['reference_last']:.4f}, less than {MIN_REFERENCE_DROP:.0%} of its "
        "start; learning cannot be judged on this run",
        **numbers,
    )


def _max_gap(
    name: str,
    ours: dict[int, float | None],
    theirs: dict[int, float | None],
    steps: list[int],
    numbers: dict[str, Any],
) -> Check:
    """[Note: learning margin]: a candidate's worst held-out gap to the reference."""
    if any(ours.get(step) is None for step in steps):
        return _check(name, "fail", "held-out loss missing or non-finite at an evaluation step")
    margin, drop = numbers["margin"], numbers["reference_drop"]
    gaps = {step: ours[step] - theirs[step] for step in steps}
    worst_step = max(gaps, key=lambda step: gaps[step])
    how = (
        f"max({MARGIN_FACTOR:g} x calibration gap {numbers['noise_gap']:.4g}, "
        f"{MARGIN_FLOOR:.0%} of the reference's drop {drop:.4g})"
        if numbers["noise_gap"] is not None
        else f"{MARGIN_FLOOR:.0%} of the reference's drop {drop:.4g} (no calibration arm)"
    )
    return _check(
        name,
        "pass" if gaps[worst_step] <= margin else "fail",
        f"held-out loss minus the reference's: worst {gaps[worst_step]:+.4g} at step "
        f"{worst_step} (last {gaps[max(steps)]:+.4g}); margin {margin:.4g} = {how}",
        worst_gap=gaps[worst_step],
        worst_step=worst_step,
        margin=margin,
    )


def _horizon(record: Record, arm: str, reference: str) -> Check:
    """[Note: non-inferiority over the horizon] (qualify/evidence/horizon.py) for one
    candidate, with its gap series at every evaluation."""
    batches = {t.arm: {h.step: h.batch_losses for h in t.held_out} for t in record.trajectories}
    means = _held_out(record)
    calibration = record.learning.calibration_arm
    judged = horizon.judge(
        batches.get(arm, {}),
        batches[reference],
        batches.get(calibration) if calibration else None,
        means[reference],
        record.learning.eval_steps,
        record.workload.steps,
    )
    series = horizon.gap_series(means.get(arm, {}), means[reference])
    return _check(f"learning[{arm}]", judged.status, judged.detail, **judged.numbers, gaps=series)


@rule(SPEED, 1)
def summarize_blocks(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The derived speed fields of a Performance from its raw block times."""
    timings = [
        stats.BlockTiming(block["order"], block["reference_times_s"], block["candidate_times_s"])
        for block in blocks
    ]
    derived_blocks = []
    for index, (block, timing) in enumerate(zip(blocks, timings, strict=True)):
        reference_s = statistics.median(timing.reference_times)
        candidate_s = statistics.median(timing.candidate_times)
        derived_blocks.append(
            {
                "index": index,
                "order": block["order"],
                "reference_times_s": list(timing.reference_times),
                "candidate_times_s": list(timing.candidate_times),
                "reference_step_s": reference_s,
                "candidate_step_s": candidate_s,
                "speedup": reference_s / candidate_s if candidate_s > 0 else math.inf,
                **gather_speed.block_fields(block),
            }
        )
    gather = gather_speed.summary(derived_blocks, MIN_BLOCKS_FOR_INTERVAL)
    if len(timings) < MIN_BLOCKS_FOR_INTERVAL:
        return {
            "blocks": derived_blocks,
            "interval": "insufficient blocks",
            "median_speedup": None,
            "ci_low": None,
            "ci_high": None,
            "ci_method": f"none: {len(timings)} blocks < {MIN_BLOCKS_FOR_INTERVAL}",
            "p_value": None,
            "test": "none: too few blocks",
            **gather,
        }
    summary = stats.summarize(timings)
    return {
        "blocks": derived_blocks,
        "interval": "bootstrap",
        "median_speedup": summary.median_speedup,
        "ci_low": summary.ci_low,
        "ci_high": summary.ci_high,
        "ci_method": summary.ci_method,
        "p_value": summary.p_value,
        "test": summary.test,
        **gather,
    }
