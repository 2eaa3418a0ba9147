"""The judge's rules, one module per check family, and which version of its rule judged each
check: ``RULES`` maps every check family to an integer.

The families and their modules (checks.py composes them in the order a record stores them):
``finite`` (finite.py), ``step1-exact`` (step_one.py), ``update`` (exact_update.py),
``overflow-pattern`` (overflow_pattern.py), ``own-shard`` (schemes.py), ``replicas``
(identical_replicas.py), ``reproduced`` (reproduced.py), ``probe`` (group_size_on_wire.py),
``in-effect`` (in_effect.py), ``bounded`` (bounded.py), ``learning`` (learning.py, with
horizon.py), ``speedup`` (speedup.py), ``conformance`` (conformance.py) and ``speed``
(speed.py). Their shared arithmetic is the contract's, beside it: the wire in bytes
(evidence/wire.py), the staging bound (evidence/staging.py), the spec (evidence/spec.py).

[Note: rule versions]
A check's family is its name without the arm (``own-shard[candidate-g64]`` is ``own-shard``).
The function that derives a family is decorated ``@rule(family, version)``: the
decorator registers the version in ``RULES`` and stamps it on every ``Check`` the function
returns (``Check.rule``). Bump a family's version whenever what it decides can change for the
same observations: its status, its numbers, or a normative constant it reads (judge.py's
``CONSTANTS``; the golden test names the rule to bump). A detail's wording is presentation:
never versioned, never compared. ``speed`` is not a check: it versions the speed summaries
derived from the block times (speed.summarize_blocks: the interval, the bootstrap).

Loading a record (rejudge.py): a stored check whose rule equals today's must be re-derived with
the same status and numbers, else the record is refused (the rule changed without its bump,
or the record was altered); a check of another rule version is kept *as judged* and today's
rule is applied to the same observations beside it. ``inputs`` names the record fields a rule
reads that older schemas lack (``section[].field``, or deeper: ``probes[].wire[].field``): a
record without them gets "not observed" under that rule instead of a verdict on data it never
had.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from qwz.qualify.evidence.schema import Check

RULES: dict[str, int] = {}
"""Family -> today's rule version (filled by ``@rule``; judge.py seals it in every record)."""
INPUTS: dict[str, tuple[str, ...]] = {}
"""Family -> the record fields its rule needs that an older schema may lack."""
SPEED = "speed"

F = TypeVar("F", bound=Callable[..., Any])


def check(name: str, status: str, detail: str, **numbers: Any) -> Check:
    """A ``Check`` as a rule returns it (``rule`` stamps its version)."""
    return Check(name=name, status=status, detail=detail, numbers=numbers)


def family_of(name: str) -> str:
    """``own-shard[candidate-g64]`` -> ``own-shard``."""
    return name.split("[", 1)[0]


def _stamp(result: Any, version: int) -> Any:
    if isinstance(result, Check):
        return result.model_copy(update={"rule": version})
    if isinstance(result, list):
        return [_stamp(item, version) for item in result]
    return result


def rule(family: str, version: int, *, inputs: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register ``family`` at ``version`` and stamp the version on the checks it returns."""
    if type(version) is not int or version < 1:
        raise ValueError(f"rule {family!r}: version {version!r} is not a positive integer")

    def decorate(function: F) -> F:
        if RULES.get(family, version) != version:
            raise ValueError(
                f"rule {family!r} is registered at version {RULES[family]}, not {version}"
            )
        RULES[family] = version
        INPUTS[family] = tuple(inputs)

        @functools.wraps(function)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            return _stamp(function(*args, **kwargs), RULES[family])

        return stamped  # type: ignore[return-value]

    return decorate


def version_of(name: str) -> int | None:
    """Today's rule version of the check called ``name``; None for a family no rule derives."""
    return RULES.get(family_of(name))
