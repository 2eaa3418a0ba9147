"""Resuming a DeepSpeed + qwz engine: exact, or refused (see [Note: lossless resume]).

A checkpoint of a taken-over engine holds the quantized working weights (the
module) and the fp32 masters (the ZeRO files). Modelled on DeepSpeed's own
``TestZeROCheckpoint::test_load_module_only`` and ``test_not_load_optimizer_state``
(stages 1 and 2): a load with ``load_module_only=True`` or
``load_optimizer_states=False`` must restore the masters from the checkpoint's fp32
partitions bit for bit, not rebuild them from the int8 working weights, and with an
optimizer that has no state (SGD) both engines must then stay bit-identical for more
steps. Every load that has no usable fp32 master (``load_from_fp32_weights: false``,
no ZeRO checkpoint, deleted ZeRO files, a direct ``refresh_fp32_params()``) must
raise ``LossyResumeError`` naming the full load, on every rank, and leave the masters
not equal to the working copy (on stock DeepSpeed they are equal: the int8 error
became permanent). A full load is asserted bit-exact, and stays so for one more step.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="the DeepSpeed integration tests need deepspeed (pip install .[deepspeed])"
)

from tests.multigpu import resume_ranks

pytestmark = [pytest.mark.multigpu]

LOSSY = [
    "bit16_weights",
    "missing_zero_checkpoint",
    "module_only_zero_files_deleted",
    "module_only_zero_file_of_rank1_deleted",
]
WEIGHTS_ONLY = ["module_only", "optimizer_states_false"]


def _assert_refused(result):
    assert result["error"] is not None, "the lossy load was not refused"
    for safe in ("load_optimizer_states=True", "load_from_fp32_weights"):
        assert safe in result["error"]


@pytest.mark.parametrize("how", LOSSY)
def test_load_without_fp32_masters_is_refused_not_quantized_into_masters(worlds, tmp_path, how):
    results = worlds.get(2).run(resume_ranks.save_then_load, str(tmp_path), how)
    for result in results:
        assert not result["masters_are_working_copy"], "masters rebuilt from int8 weights"
        _assert_refused(result)
    if how == "module_only_zero_file_of_rank1_deleted":  # rank 0 had its file: the vote
        assert "another rank" in results[0]["error"]
        assert "is missing" in results[1]["error"]


def test_direct_refresh_fp32_params_is_refused(worlds):
    for result in worlds.get(2).run(resume_ranks.refresh_outside_a_load):
        _assert_refused(result)
        assert "not called from engine.load_checkpoint" in result["error"]
        assert result["masters_unchanged"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("how", WEIGHTS_ONLY)
def test_weights_only_load_restores_the_saved_fp32_masters_bit_for_bit(
    worlds, tmp_path, how, stage
):
    results = worlds.get(2).run(resume_ranks.save_then_load, str(tmp_path), how, stage=stage)
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["masters_exact"]
        assert not result["masters_are_working_copy"]  # the masters are not the int8 decode
        saved_hash, loaded_hash = result["hashes_after_load"]
        assert saved_hash == loaded_hash


@pytest.mark.parametrize("how", WEIGHTS_ONLY)
def test_weights_only_resume_of_a_stateless_optimizer_continues_the_run_exactly(
    worlds, tmp_path, how
):
    results = worlds.get(2).run(
        resume_ranks.save_then_load, str(tmp_path), how, optimizer="sgd", more_steps=2
    )
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["masters_exact"]
        assert result["masters_exact_after_steps"] == [True, True]
        assert all(saved == loaded for saved, loaded in result["hashes_after_steps"])


def test_full_save_load_round_trip_is_bit_exact(worlds, tmp_path):
    results = worlds.get(2).run(resume_ranks.save_then_load, str(tmp_path), "full", more_steps=1)
    for result in results:
        assert result["error"] is None
        assert result["masters_exact"]
        assert not result["masters_are_working_copy"]  # the masters are not the int8 decode
        saved_hash, loaded_hash = result["hashes_after_load"]
        assert saved_hash == loaded_hash
        assert result["masters_exact_after_steps"] == [True]
        saved_hash, loaded_hash = result["hashes_after_steps"][0]
        assert saved_hash == loaded_hash
