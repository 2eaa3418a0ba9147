"""Resuming a DeepSpeed + qwz engine: exact, or refused (see [Note: lossy resume]).

A checkpoint of a taken-over engine holds the quantized working weights (the
module) and the fp32 masters (the ZeRO files). Every DeepSpeed load that would
rebuild the masters from the module's weights ends in
``_restore_from_bit16_weights``; each such way is asserted to raise
``LossyResumeError`` naming the full load, on every rank, and to leave the masters
not equal to the working copy (on stock DeepSpeed they are equal: the int8
error became permanent). A full load is asserted bit-exact, and stays so for
one more step.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "deepspeed", reason="the DeepSpeed integration tests need deepspeed (pip install .[deepspeed])"
)

from tests.multigpu import resume_ranks

pytestmark = [pytest.mark.multigpu]

LOSSY = ["optimizer_states_false", "module_only", "bit16_weights", "missing_zero_checkpoint"]


@pytest.mark.parametrize("how", LOSSY)
def test_weights_only_resume_is_refused_not_quantized_into_masters(worlds, tmp_path, how):
    results = worlds.get(2).run(resume_ranks.save_then_load, str(tmp_path), how)
    for result in results:
        assert not result["masters_are_working_copy"], "masters rebuilt from int8 weights"
        assert result["error"] is not None, "the lossy load was not refused"
        for safe in ("load_optimizer_states=True", "load_from_fp32_weights"):
            assert safe in result["error"]


def test_full_save_load_round_trip_is_bit_exact(worlds, tmp_path):
    for result in worlds.get(2).run(resume_ranks.save_then_load, str(tmp_path), "full"):
        assert result["error"] is None
        assert result["masters_exact"]
        assert not result["masters_are_working_copy"]  # the masters are not the int8 decode
        saved_hash, loaded_hash = result["hashes_after_load"]
        assert saved_hash == loaded_hash
        assert result["masters_exact_after_step"]
        saved_hash, loaded_hash = result["hashes_after_step"]
        assert saved_hash == loaded_hash
