"""``reproduced[arm]``: the arm's final hash against the ledger's for the same head and
environment (evidence/ledger.py)."""

from __future__ import annotations

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.rules.identical_replicas import arm_final_hash
from qwz.qualify.evidence.schema import Check


@rule("reproduced", 1)
def reproduced(hashes) -> Check:
    name = f"reproduced[{hashes.arm}]"
    this = arm_final_hash(hashes.per_rank, [item.hashes for item in hashes.replica_sets])
    others = "".join(
        f"; {'same hash as' if other == this else 'differs from'} the {description} arm's "
        f"{other[:16]}"
        for description, other in hashes.ledger_siblings.items()
    )
    if hashes.ledger_status == "not-checked":
        return check(name, "n/a", "no ledger given (--ledger), or the replicas disagree")
    if hashes.ledger_status == "recorded":
        return check(
            name, "n/a", "first run of this head, environment and arm: hash recorded" + others
        )
    if hashes.ledger_status == "reproduced":
        return check(
            name, "pass", f"reproduced the ledger's hash {str(this)[:16]}{others}", this_run=this
        )
    return check(
        name,
        "fail",
        f"MISMATCH: this run {str(this)[:16]}, ledger {str(hashes.ledger_previous)[:16]} for "
        f"the same head and environment{others}",
        this_run=this,
        ledger=hashes.ledger_previous,
    )
