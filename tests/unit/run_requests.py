"""``qwz-qualify run`` arguments resolved and checked as ``run`` does ([Note: a request resolved
once] in qwz/qualify/request/run_request.py), for the unit tests of the request."""

from __future__ import annotations

import argparse

from qwz.qualify.base.plan import RunPlan
from qwz.qualify.request import preflight, run_request


def plan_of(args: argparse.Namespace) -> RunPlan:
    """The plan ``run`` would train (``Refused``: a request it refuses unresolved)."""
    return run_request.resolve(args).plan


def problems_of(args: argparse.Namespace) -> list[str]:
    """Every line ``run`` would refuse the request with (none: it would run)."""
    try:
        request = run_request.resolve(args)
    except run_request.Refused as refused:
        return refused.problems
    return preflight.problems(request)
