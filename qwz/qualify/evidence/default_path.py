"""Is a pull request's default path unchanged? Its base's and its head's reference arm,
compared bit for bit: a pure function of the two records.

[Note: default path unchanged]
The reference arm (``zero_quantized_weights: false``) is the path every user who does not
opt in runs; a PR that adds the quantized gather claims it leaves that path as it was. Two
runs of the same code, on the same data, in the same environment, are bit for bit the same
(the ranks run deterministically: [Note: deterministic ranks], qualify/run/determinism.py),
so the claim is checked exactly, with no tolerance:

* every step's loss (the forward pass of the weights the step before left),
* every step's fp32 masters, per parameter, by their short layout-independent digests
  ([Note: short digests], qualify/run/observers/digest.py): a change the per-step checks
  cannot see -- a tiny rescale of the gradient before its norm, a different rounding of the
  masters -- is consistent within one run, and shows here at the first step it acts,
* the final hash of the working weights, on every rank.

The first difference is reported by step, then parameter: the masters after step ``k``
differ before the loss of step ``k + 1`` can. The two runs must be comparable: the same
subject, workload, reference config, world size and environment (the DeepSpeed version may
differ: it is part of what the PR changes); otherwise, and where a record lacks what is
compared (records of schema 4 and older kept no per-step masters), the claim is
inconclusive and the result says what could not be compared.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from qwz.qualify.evidence.schema import Record

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


class Difference(NamedTuple):
    """The first place where the head's reference arm differs from the base's."""

    step: int | None
    """1-based step; None for the final hashes (after the last step)."""
    what: str
    """"loss", "masters" or "final hash"."""
    parameter: str | None
    detail: str


class DefaultPath(NamedTuple):
    status: str
    """"pass", "fail" or "inconclusive"."""
    detail: str
    first: Difference | None
    """The earliest difference (by step; the final hashes last)."""
    differences: tuple[Difference, ...]
    """The first difference of each kind compared."""
    compared: tuple[str, ...]
    not_compared: tuple[str, ...]
    """What could not be compared, and why."""


def _reference(record: Record) -> str:
    return next(arm.name for arm in record.arms if arm.role == "reference")


def _setup(record: Record) -> dict[str, Any]:
    """What must be equal for two reference arms to be comparable bit for bit."""
    arm = next(arm for arm in record.arms if arm.role == "reference")
    plan = record.plan.model_dump()
    layout = plan.get("group_sizes") if record.subject.name == "qwz" else None
    return {
        "subject": record.subject.name,
        "workload": record.workload.model_dump(exclude={"num_parameters"}),
        "reference config": arm.config,
        "world size": record.environment.world_size,
        # The qwz engine aligns its shards to the group sizes ([Note: padding rule]).
        "shard layout (the group sizes)": layout,
        "environment": record.environment.fingerprint_fields(exclude=("deepspeed",)),
    }


def incomparable(base: Record, head: Record) -> list[str]:
    """Why the two reference arms cannot be compared bit for bit (empty: they can)."""
    ours, theirs = _setup(base), _setup(head)
    return [f"{key} differs" for key in ours if ours[key] != theirs[key]]


def first_loss_difference(base: list, head: list) -> Difference | None:
    for index in range(max(len(base), len(head))):
        if index >= len(base) or index >= len(head):
            shorter = "base" if index >= len(base) else "head"
            detail = f"the {shorter}'s reference ran {min(len(base), len(head))} steps only"
            return Difference(index + 1, "loss", None, detail)
        if base[index] != head[index]:
            detail = f"loss at step {index + 1}: base {base[index]!r}, head {head[index]!r}"
            return Difference(index + 1, "loss", None, detail)
    return None


def first_master_difference(base: list[dict], head: list[dict]) -> Difference | None:
    """The first step, and in the base's parameter order the first parameter, whose master
    digest differs (a parameter one side lacks differs)."""
    for index in range(max(len(base), len(head))):
        step = index + 1
        if index >= len(base) or index >= len(head):
            detail = f"masters after step {step}: observed on one side only"
            return Difference(step, "masters", None, detail)
        ours, theirs = base[index], head[index]
        for name in [*ours, *(name for name in theirs if name not in ours)]:
            if ours.get(name) != theirs.get(name):
                detail = (
                    f"fp32 master of {name} after step {step}: digest base "
                    f"{ours.get(name, '(none)')}, head {theirs.get(name, '(none)')}"
                )
                return Difference(step, "masters", name, detail)
    return None


def _final_hashes(record: Record) -> list:
    hashes = next(item for item in record.hashes if item.arm == _reference(record))
    sets = [(item.params, item.ranks, item.hashes) for item in hashes.replica_sets]
    return [hashes.per_rank, sets]


def final_hash_difference(base: Record, head: Record) -> Difference | None:
    ours, theirs = _final_hashes(base), _final_hashes(head)
    if ours == theirs:
        return None
    shown = [str(value)[:16] for value in (ours[0][:1] + theirs[0][:1])]
    detail = f"final hash of the working weights: base {shown[0]}, head {shown[-1]} (rank 0)"
    return Difference(None, "final hash", None, detail)


def _step_masters(record: Record) -> list[dict] | None:
    name = _reference(record)
    return next((item.digests for item in record.step_masters if item.arm == name), None)


def _lacks_masters(side: str, record: Record) -> str:
    schema = f"schema {record.upgraded_from}" if record.upgraded_from else "this record"
    return f"masters: the {side} record ({schema}) has no per-step master digests"


def compare_default_path(base: Record, head: Record) -> DefaultPath:
    """[Note: default path unchanged]: the head's reference arm against the base's."""
    problems = incomparable(base, head)
    if problems:
        detail = "not comparable bit for bit: " + "; ".join(problems)
        return DefaultPath(INCONCLUSIVE, detail, None, (), (), tuple(problems))
    trajectories = [
        next(t for t in record.trajectories if t.arm == _reference(record))
        for record in (base, head)
    ]
    found = [first_loss_difference(trajectories[0].losses, trajectories[1].losses)]
    compared, not_compared = ["losses"], []
    masters = [_step_masters(base), _step_masters(head)]
    if masters[0] is None or masters[1] is None:
        side, record = ("base", base) if masters[0] is None else ("head", head)
        not_compared.append(_lacks_masters(side, record))
    else:
        compared.append("masters")
        found.append(first_master_difference(masters[0], masters[1]))
    compared.append("final hashes")
    found.append(final_hash_difference(base, head))
    return _verdict([item for item in found if item is not None], compared, not_compared)


def _order(item: Difference) -> tuple:
    """Steps in order, the final hashes after them; at one step the loss (its forward) comes
    before the masters (its update)."""
    return (item.step is None, item.step or 0, item.what != "loss")


def _verdict(found: list[Difference], compared: list[str], not_compared: list[str]):
    kept = (tuple(compared), tuple(not_compared))
    if found:
        first = min(found, key=_order)
        where = f"step {first.step}" if first.step is not None else "the final weights"
        name = f", {first.parameter}" if first.parameter else ""
        detail = f"differs first at {where}{name}: " + "; ".join(item.detail for item in found)
        return DefaultPath(FAIL, detail, first, tuple(sorted(found, key=_order)), *kept)
    same = f"{', '.join(compared)} equal bit for bit"
    if not_compared:
        detail = f"{same}; not compared: {'; '.join(not_compared)}"
        return DefaultPath(INCONCLUSIVE, detail, None, (), *kept)
    return DefaultPath(PASS, same, None, (), *kept)
