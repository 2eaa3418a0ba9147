"""``replicas[arm]``: the ranks' working copies identical after every step and at the end, each
parameter over the ranks that hold it ([Note: replica sets] in qualify/run/replicas.py); and
an arm's final hash, which the ledger keys on."""

from __future__ import annotations

import hashlib

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Check


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
def replicas(hashes, world_size: int) -> Check:
    """Replicas identical after every step and at the end, each parameter over the ranks
    that hold it ([Note: replica sets])."""
    name = f"replicas[{hashes.arm}]"
    if world_size == 1:
        return check(name, "n/a", "one rank: there are no replicas to compare")
    if hashes.divergence is not None:
        return check(
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
        return check(name, "n/a", "the arm failed before its final hash")
    disagree = [
        f"{params} over ranks {ranks}: " + ", ".join(str(h)[:16] for h in values)
        for params, ranks, values in sets
        if len(set(values)) != 1
    ]
    if disagree:
        return check(name, "fail", "ranks' final hashes disagree: " + "; ".join(disagree[:4]))
    if len(sets) == 1:
        return check(
            name,
            "pass",
            f"working copies identical on all {len(sets[0][1])} ranks after every "
            f"step; final hash {str(sets[0][2][0])[:16]}",
        )
    return check(
        name,
        "pass",
        "working copies identical after every step within every replica set ("
        + "; ".join(f"{params}: ranks {ranks}" for params, ranks, _ in sets[:6])
        + (" ..." if len(sets) > 6 else "")
        + f"); final hash {str(arm_final_hash(hashes.per_rank, [s[2] for s in sets]))[:16]}",
        sets=len(sets),
    )
