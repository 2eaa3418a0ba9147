"""[Note: observed at the next use] (qwz/qualify/run/next_use.py): the working copy is observed
at the start of the model's next forward -- after every forward pre-hook, a candidate's
late decode included -- and after the last step at a final forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from qwz.qualify.run.next_use import NextUse
from qwz.qualify.run.observers import step_memory


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def _late_decode(model: torch.nn.Module, decoded: dict) -> None:
    """A candidate whose decode lands in a forward pre-hook."""

    def hook(module, args):
        if "weight" in decoded:
            with torch.no_grad():
                module.weight.copy_(decoded.pop("weight"))

    model.register_forward_pre_hook(hook)


@pytest.mark.parametrize("hook_first", [True, False], ids=["hook-then-wrap", "wrap-then-hook"])
def test_the_observation_sees_what_a_pre_hook_decoded(hook_first):
    """Whenever the candidate registered its hook, the observation runs after it."""
    model, decoded, seen = _model(), {}, []
    if hook_first:
        _late_decode(model, decoded)
    use = NextUse(model)
    if not hook_first:
        _late_decode(model, decoded)
    decoded["weight"] = torch.full_like(model.weight, 7.0)
    use.defer("after step 1", lambda: seen.append(model.weight.detach().clone()))
    assert use.pending == "after step 1" and seen == []  # not at step()'s return
    model(torch.ones(3, 4))
    assert len(seen) == 1 and bool((seen[0] == 7.0).all())
    assert use.pending is None
    model(torch.ones(3, 4))  # nothing pending: nothing observed again
    assert len(seen) == 1


def test_the_observation_runs_without_gradients_and_inside_the_pause():
    model, events = _model(), []

    @contextlib.contextmanager
    def pause():
        events.append("pause")
        yield
        events.append("resume")

    use = NextUse(model, pause=pause)
    use.defer("step 1", lambda: events.append(torch.is_grad_enabled()))
    model(torch.ones(1, 4)).sum().backward()  # the forward itself keeps its gradients
    assert events == ["pause", False, "resume"]
    assert model.weight.grad is not None


def test_settle_runs_a_final_forward_for_the_last_step():
    model, decoded, seen = _model(), {}, []
    _late_decode(model, decoded)
    use = NextUse(model)
    decoded["weight"] = torch.full_like(model.weight, 3.0)
    use.defer("step 8", lambda: seen.append(float(model.weight[0, 0])))
    uses = []
    use.settle(lambda: uses.append(model(torch.ones(1, 4))))
    assert seen == [3.0] and len(uses) == 1 and use.pending is None
    use.settle(lambda: pytest.fail("nothing pending: no forward"))


def test_a_final_forward_that_misses_the_model_is_the_harness_error():
    model = _model()
    use = NextUse(model)
    use.defer("step 8", lambda: None)
    with pytest.raises(RuntimeError, match="harness: the final forward did not reach"):
        use.settle(lambda: None)


def test_a_step_deferred_while_one_waits_is_the_harness_error():
    use = NextUse(_model())
    use.defer("the weights after step 1", lambda: None)
    with pytest.raises(RuntimeError, match="harness: the weights after step 2 deferred while"):
        use.defer("the weights after step 2", lambda: None)


def test_close_restores_the_forward():
    model = _model()
    use = NextUse(model)
    assert "forward" in model.__dict__
    use.defer("step 1", lambda: pytest.fail("closed: never observed"))
    use.close()
    assert "forward" not in model.__dict__
    model(torch.ones(1, 4))


def test_the_step_peak_does_not_charge_the_paused_observation(monkeypatch):
    """[Note: peak around the train step]: the peak of a step with a paused observation
    inside it is the larger of its parts before and after the pause, not the pause's."""
    readings = iter([100, 900, 150])  # before the pause, (the pause), after it
    current = {"peak": 0}

    def peak_memory():
        return {"kind": "rss", "peak_allocated_bytes": current["peak"], "peak_reserved_bytes": None}

    monkeypatch.setattr(step_memory, "peak_memory", peak_memory)
    monkeypatch.setattr(step_memory, "reset_peak_memory", lambda: current.update(peak=0))
    peak = step_memory.StepPeak()
    with peak.around_step():
        current["peak"] = next(readings)
        with peak.paused():
            current["peak"] = next(readings)
        current["peak"] = max(current["peak"], next(readings))
    assert peak.result()["peak_allocated_bytes"] == 150
    with peak.paused():  # outside a step: nothing to pause
        pass
    assert peak.steps == 1
