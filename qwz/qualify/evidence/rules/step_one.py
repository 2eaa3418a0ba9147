"""``step1-exact[arm]``: after the first optimizer step a candidate's fp32 masters equal the
reference's bit for bit (same start, same first gradient: no gather has run yet)."""

from __future__ import annotations

from typing import Any

from qwz.qualify.evidence.rules import check, rule
from qwz.qualify.evidence.schema import Check


@rule("step1-exact", 1)
def step_one(arm: str, digests: dict[str, Any], reference: str | None) -> Check:
    """Step 1 (the first optimizer step: later where fp16 overflows skipped the first): a
    candidate's masters equal the reference's, bit for bit."""
    name = f"step1-exact[{arm}]"
    their_item, our_item = digests.get(reference or ""), digests.get(arm)
    theirs = their_item.digests if their_item else None
    ours = our_item.digests if our_item else None
    if theirs is None or ours is None:
        who = arm if ours is None else "the reference"
        return check(name, "n/a", f"{who} did not complete step 1")
    if our_item.step != their_item.step:
        return check(
            name,
            "fail",
            f"the first optimizer step was step {our_item.step}, the reference's step "
            f"{their_item.step}: with the same weights and batches until then, they differ",
        )
    differing = sorted(key for key in theirs if ours.get(key) != theirs[key])
    differing += sorted(set(ours) - set(theirs))
    if differing:
        return check(
            name,
            "fail",
            f"after step 1 the fp32 masters of {len(differing)} of {len(theirs)} "
            f"parameters differ from the reference's: {', '.join(differing[:8])}"
            + (" ..." if len(differing) > 8 else ""),
            differing=len(differing),
        )
    at = "step 1" if our_item.step in (None, 1) else f"the first optimizer step ({our_item.step})"
    return check(
        name,
        "pass",
        f"after {at} all {len(theirs)} parameters' fp32 masters equal the "
        "reference's bit for bit (same start, same first gradient)",
        parameters=len(theirs),
    )
