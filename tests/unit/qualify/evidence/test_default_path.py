"""[Note: default path unchanged] (qwz/qualify/evidence/default_path.py): a PR's base and head
reference arms compared bit for bit, from two records made by tests/unit/records.py."""

from __future__ import annotations

import copy

from qwz.qualify.evidence import seal
from qwz.qualify.evidence.default_path import FAIL, INCONCLUSIVE, PASS, compare_default_path
from tests.unit.records import PARAMETER_NAMES, make_payload, make_step_masters


def _digests(arm: str, step: int) -> dict[str, str]:
    return make_step_masters((arm,), step)[0]["digests"][-1]


def payload(edit=None) -> dict:
    """A record's payload with every arm's masters after every step; `edit` changes it."""
    data = make_payload(step_masters=make_step_masters())
    if edit is not None:
        edit(data)
    return data


def compared(edit_head=None, edit_base=None):
    base = seal.seal(payload(edit_base))
    head = seal.seal(payload(edit_head))
    return compare_default_path(base, head)


def _reference(data: dict, section: str) -> dict:
    return next(item for item in data[section] if item["arm"] == "reference")


def test_equal_reference_arms_pass():
    result = compared()
    assert result.status == PASS and result.first is None
    assert result.compared == ("losses", "masters", "final hashes")
    assert result.detail == "losses, masters, final hashes equal bit for bit"


def test_a_loss_that_differs_at_step_k_fails_naming_the_step():
    def nudge(data):
        losses = _reference(data, "trajectories")["losses"]
        losses[6] = losses[6] + 1e-12  # step 7, in the last bits

    result = compared(edit_head=nudge)
    assert result.status == FAIL
    assert (result.first.step, result.first.what, result.first.parameter) == (7, "loss", None)
    assert result.detail.startswith("differs first at step 7: loss at step 7: base ")


def test_a_master_that_differs_at_step_k_fails_naming_step_and_parameter():
    """The masters of step 3 differ in one parameter, the loss from step 4 on: the first
    difference is the masters after step 3, in that parameter."""

    def change(data):
        digests = _reference(data, "step_masters")["digests"]
        digests[2] = dict(digests[2], **{PARAMETER_NAMES[1]: "00000000"})
        losses = _reference(data, "trajectories")["losses"]
        losses[3:] = [value + 1e-9 for value in losses[3:]]

    result = compared(edit_head=change)
    assert result.status == FAIL
    first = result.first
    assert (first.step, first.what, first.parameter) == (3, "masters", PARAMETER_NAMES[1])
    assert [item.what for item in result.differences] == ["masters", "loss"]
    assert result.detail.startswith(f"differs first at step 3, {PARAMETER_NAMES[1]}: ")


def test_a_loss_and_its_own_steps_masters_report_the_loss_first():
    """At one step the forward (the loss) comes before the update (the masters)."""

    def change(data):
        _reference(data, "step_masters")["digests"][4][PARAMETER_NAMES[0]] = "ffffffff"
        _reference(data, "trajectories")["losses"][4] += 1e-9

    assert compared(edit_head=change).first.what == "loss"


def test_a_final_hash_that_differs_fails_after_the_last_step():
    def change(data):
        _reference(data, "hashes")["per_rank"] = ["0" * 64, "0" * 64]

    result = compared(edit_head=change)
    assert result.status == FAIL
    assert (result.first.step, result.first.what) == (None, "final hash")
    assert result.detail.startswith("differs first at the final weights: final hash")


def test_only_the_reference_arm_is_compared():
    def change(data):
        candidate = next(item for item in data["step_masters"] if item["arm"] == "candidate-g64")
        candidate["digests"][0] = _digests("other", 1)

    assert compared(edit_head=change).status == PASS


def test_a_record_without_the_digests_says_what_it_could_not_compare():
    result = compared(edit_base=lambda data: data.pop("step_masters"))
    assert result.status == INCONCLUSIVE
    assert result.compared == ("losses", "final hashes")
    assert result.not_compared == ("masters: the base record (this record) has no per-step "
                                   "master digests",)  # fmt: skip
    assert "losses, final hashes equal bit for bit; not compared: masters" in result.detail


def test_a_record_without_the_digests_still_fails_on_what_it_has():
    def nudge(data):
        _reference(data, "trajectories")["losses"][0] += 1e-9

    result = compared(edit_head=nudge, edit_base=lambda data: data.pop("step_masters"))
    assert result.status == FAIL and result.first.step == 1
    assert result.not_compared  # and still says what it could not compare


def test_runs_that_cannot_be_compared_bit_for_bit_are_inconclusive():
    def other_seed(data):
        data["workload"] = dict(copy.deepcopy(data["workload"]), seed=99)

    result = compared(edit_head=other_seed)
    assert result.status == INCONCLUSIVE and result.not_compared == ("workload differs",)

    def other_torch(data):
        data["environment"] = dict(data["environment"], torch="9.9.9")

    assert compared(edit_head=other_torch).not_compared == ("environment differs",)


def test_the_subjects_own_version_may_differ():
    """What the PR changes includes DeepSpeed's version: it is not part of the setup."""

    def version(data):
        data["environment"] = dict(data["environment"], deepspeed="0.20.0")

    assert compared(edit_head=version).status == PASS
