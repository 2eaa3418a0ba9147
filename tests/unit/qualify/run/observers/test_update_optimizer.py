"""Which optimizer ``update`` re-derives, read from the arm's config in the record
([Note: the optimizer the update check re-derives], qwz/qualify/evidence/optimizer.py), and
``update`` n/a naming an optimizer it does not re-derive -- never a FAIL of a formula the arm
never ran, and never a PASS that hides a missing step or a wrong handed norm."""

from __future__ import annotations

import pytest

from qwz.qualify.evidence.optimizer import AdamWSettings, adamw_of, clipping_of
from tests.unit.records import CANDIDATE, make_payload, make_record


def adam(kind: str = "AdamW", **params) -> dict:
    return {"optimizer": {"type": kind, "params": params}}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # DeepSpeed's FusedAdam / CPU Adam (torch_adam absent or false): weight decay 0.
        (adam(), AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.0)),
        (adam("Adam"), AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.0)),
        # torch's AdamW (torch_adam true, "AdamW" or decoupled "Adam"): weight decay 0.01.
        (adam(torch_adam=True), AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.01)),
        (adam("adam", torch_adam=True), AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.01)),
        # Adam with L2 decay is AdamW where there is no decay (torch.optim.Adam's default 0).
        (
            adam("Adam", adam_w_mode=False, torch_adam=True),
            AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.0),
        ),
        # "AdamW" ignores adam_w_mode, as DeepSpeed does.
        (adam(adam_w_mode=False, weight_decay=0.1), AdamWSettings(1e-3, (0.9, 0.999), 1e-8, 0.1)),
        (
            adam(lr=2e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.05),
            AdamWSettings(2e-4, (0.8, 0.95), 1e-6, 0.05),
        ),
    ],
)
def test_adam_and_adamw_read_as_deepspeed_builds_them(config, expected):
    assert adamw_of(config) == expected


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (adam("SGD", lr=0.1), "the optimizer is 'SGD', not Adam or AdamW"),
        (adam("Lamb"), "the optimizer is 'Lamb', not Adam or AdamW"),
        (
            adam("Adam", adam_w_mode=False, weight_decay=0.1),
            "the optimizer is Adam with L2 weight decay 0.1 (adam_w_mode false), not AdamW",
        ),
        ({}, "the config has no optimizer section"),
        (adam(lr="fast"), "are not numbers"),
    ],
)
def test_any_other_optimizer_is_named_not_re_derived(config, reason):
    assert reason in adamw_of(config)


def test_clipping_is_deepspeed_s_zero_where_the_config_leaves_it_out():
    assert (clipping_of({}), clipping_of({"gradient_clipping": 0.5})) == (0.0, 0.5)


def with_optimizer(section: dict, **updates) -> dict:
    payload = make_payload()
    for arm in payload["arms"]:
        arm["config"]["optimizer"] = section
    for item in payload["updates"]:
        if item["arm"] == CANDIDATE:
            item.update(updates)
    return make_record(arms=payload["arms"], updates=payload["updates"])


def test_update_is_n_a_for_an_arm_whose_optimizer_is_not_re_derived():
    record = with_optimizer({"type": "SGD", "params": {"lr": 0.1}}, checked=0, max_ratio=0.0)
    check = {check.name: check for check in record.checks}[f"update[{CANDIDATE}]"]
    assert check.status == "n/a"
    assert check.detail.startswith(
        "the optimizer is 'SGD', not Adam or AdamW: the update is not re-derived (AdamW only); "
        "the handed gradient's global norm matched"
    )
    assert record.verdict.status == "PASS"


@pytest.mark.parametrize(
    "broken",
    [
        {"norm_violations": 3},  # a wrong clip is wrong whatever the optimizer
        {"missing_steps": [[4, 1]], "violations": 1},  # a skipped step too
    ],
)
def test_a_wrong_norm_or_a_missing_step_still_fails_whatever_the_optimizer(broken):
    record = with_optimizer({"type": "SGD", "params": {"lr": 0.1}}, checked=0, **broken)
    check = {check.name: check for check in record.checks}[f"update[{CANDIDATE}]"]
    assert check.status == "fail" and record.verdict.status == "FAIL"


def test_an_adamw_arm_is_judged_as_before():
    record = with_optimizer({"type": "Adam", "params": {"lr": 3e-4, "torch_adam": True}})
    check = {check.name: check for check in record.checks}[f"update[{CANDIDATE}]"]
    assert check.status == "pass" and check.rule == 2
