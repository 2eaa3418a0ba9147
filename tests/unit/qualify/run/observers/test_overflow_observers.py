"""The rank side of fp16 qualification on one process ([Note: overflow observation] and
the skip rules of the update check, qwz/qualify/run/observers/): what is recorded on a
skipped step, and what a skipped step may not change."""

from __future__ import annotations

import math

import torch

from qwz.qualify.run.observers import overflow
from tests.unit.qualify.run.observers.test_observers import _check, _optimizer_and_shard, _train


def _skipping_check(optimizer, shard):
    check = _check(optimizer, shard)
    check.skips_allowed = True
    return check


def _skip(check, step: int, during=None) -> None:
    check.begin_step(step)
    if during is not None:
        during()
    check.end_step()  # no optimizer.step() in between


def test_a_clean_skip_is_recorded_not_a_violation():
    master, optimizer, shard, generator = _optimizer_and_shard()
    check = _skipping_check(optimizer, shard)
    _skip(check, 1)
    for step in (2, 3):
        master.grad = torch.randn(master.numel(), generator=generator)
        check.begin_step(step)
        optimizer.step()
        check.end_step()
    _skip(check, 4)
    assert check.result.skipped_steps == [1, 4]
    assert check.result.violations == 0 and check.result.missing_steps == []


def test_a_master_changed_on_a_skipped_step_is_a_violation():
    master, optimizer, shard, _ = _optimizer_and_shard()
    check = _skipping_check(optimizer, shard)

    def nudge():
        with torch.no_grad():
            master.mul_(1 + 2**-20)

    _skip(check, 1, during=nudge)
    assert check.result.first_violation["what"] == (
        "master changed on a step the optimizer did not take"
    )


def test_a_skipped_step_that_advances_adams_count_is_a_violation():
    master, optimizer, shard, generator = _optimizer_and_shard()
    check = _skipping_check(optimizer, shard)
    _train(master, optimizer, check, generator, steps=2)

    def count_it():
        optimizer.state[master]["step"] += 1

    _skip(check, 3, during=count_it)
    violation = check.result.first_violation
    assert violation["step"] == 3 and "the skipped step was counted" in violation["what"]


def test_without_skips_allowed_a_skip_is_still_a_missing_step():
    _, optimizer, shard, _ = _optimizer_and_shard()
    check = _check(optimizer, shard)
    _skip(check, 1)
    assert check.result.missing_steps == [1] and check.result.skipped_steps == []


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))


def test_the_watch_sees_the_applied_scale_and_no_overflow():
    model = _model()
    watch = overflow.OverflowWatch(model)
    loss = model(torch.randn(2, 4)).pow(2).mean()
    watch.watch(loss)
    (loss.float() * 2.0**12).backward()  # as an engine scales the harness's loss
    assert watch.applied_scale() == 2.0**12
    assert not bool(watch.local_overflow)
    watch.close()


def test_the_watch_sees_an_overflowing_gradient_and_resets_per_step():
    model = _model()
    watch = overflow.OverflowWatch(model)
    loss = model(torch.randn(2, 4)).pow(2).mean()
    watch.watch(loss)
    (loss * math.inf).backward()
    assert bool(watch.local_overflow)
    model.zero_grad()
    loss = model(torch.randn(2, 4)).pow(2).mean()
    watch.watch(loss)
    assert watch.applied_scale() is None  # no backward yet: nothing reached the loss
    loss.backward()
    assert not bool(watch.local_overflow) and watch.applied_scale() == 1.0
    watch.close()
    model.zero_grad()
    loss = model(torch.randn(2, 4)).pow(2).mean()
    (loss * math.inf).backward()  # closed: the hooks are gone
    assert not bool(watch.local_overflow)
