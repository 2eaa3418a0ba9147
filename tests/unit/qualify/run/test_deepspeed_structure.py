"""Reading DeepSpeed by capability ([Note: reading DeepSpeed by capability] in
qwz/integrations/deepspeed/structure.py), a checkout's real version, and the seam's
preflight ([Note: seam preflight] in qwz/qualify/run/seam_check.py).

The optimizer objects here are stand-ins holding exactly the attributes the seam reads
(no process group: rank 0 of 1); the preflight reads real DeepSpeed sources, the ones
DeepSpeed's source distributions hold (tests/deepspeed_checkout.py ``sdist_checkout``)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import torch

from qwz.integrations.deepspeed import shards, structure
from qwz.integrations.deepspeed.structure import SeamError, parameter_offsets
from qwz.qualify.run import seam_check
from tests.deepspeed_checkout import SdistUnavailable, fetch_sdist, sdist_checkout


def _optimizer(layout: list[tuple[int, int]], flat_numel: int, listed: bool = False):
    """A stand-in DeepSpeedZeroOptimizer of one param group: parameters of the given
    (offset, numel) as views into one bf16 flat buffer (as DeepSpeed leaves them), and
    ``round_robin_bit16_offsets`` only when `listed`."""
    flat = torch.arange(flat_numel, dtype=torch.bfloat16)
    params = []
    for offset, numel in layout:
        param = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))
        param.data = flat.narrow(0, offset, numel)
        params.append(param)
    optimizer = types.SimpleNamespace(
        bit16_groups_flat=[flat],
        parallel_partitioned_bit16_groups=[[flat]],
        single_partition_of_fp32_groups=[flat.float()],
        real_dp_process_group=[None],
        round_robin_bit16_groups=[params],
        optimizer=None,
    )
    if listed:
        optimizer.round_robin_bit16_offsets = [[offset for offset, _ in layout]]
    return optimizer


def test_offsets_come_from_the_views_when_deepspeed_keeps_no_list():
    # Padding between parameters (0.19.8 pads) and a parameter of no elements (DeepSpeed's
    # master supports them) are read as they lie.
    layout = [(0, 10), (16, 5), (21, 0), (21, 11)]
    optimizer = _optimizer(layout, 32)
    assert not hasattr(optimizer, structure.OFFSETS)
    found = [(offset, numel) for _, offset, numel in parameter_offsets(optimizer, 0)]
    assert found == layout


def test_a_listed_offset_is_used_as_listed():
    optimizer = _optimizer([(0, 4), (8, 4)], 16, listed=True)
    optimizer.round_robin_bit16_offsets = [[0, 6]]  # DeepSpeed says so: believed, not the views
    assert [offset for _, offset, _ in parameter_offsets(optimizer, 0)] == [0, 6]


def test_a_parameter_that_is_no_view_and_no_list_is_a_seam_error_naming_both():
    optimizer = _optimizer([(0, 4), (4, 4)], 8)
    optimizer.round_robin_bit16_groups[0][1].data = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(SeamError, match=r"round_robin_bit16_offsets.*not a view") as caught:
        parameter_offsets(optimizer, 0)
    assert "DeepSpeed " in str(caught.value)  # which DeepSpeed (version, commit, path)


def test_a_missing_attribute_is_a_seam_error_naming_it():
    optimizer = _optimizer([(0, 8)], 8)
    del optimizer.real_dp_process_group
    # Which DeepSpeed: its version, commit and path, or (tox's unit environment has no
    # deepspeed extra) that none can be imported.
    which = "DeepSpeed " if importlib.util.find_spec("deepspeed") else "no importable DeepSpeed "
    with pytest.raises(SeamError, match=rf"\.real_dp_process_group, which {which}"):
        shards.own_shards(optimizer)


def test_offsets_that_overlap_or_leave_the_buffer_are_a_seam_error():
    optimizer = _optimizer([(0, 8), (4, 4)], 8, listed=True)
    with pytest.raises(SeamError, match="offset 4 of a parameter of 4 elements"):
        parameter_offsets(optimizer, 0)
    optimizer = _optimizer([(0, 8)], 8, listed=True)
    optimizer.round_robin_bit16_offsets = [[1]]
    with pytest.raises(SeamError, match=r"not in \[0, 0\]"):
        parameter_offsets(optimizer, 0)


def test_own_shards_of_a_deepspeed_without_the_offsets_list_place_every_parameter():
    optimizer = _optimizer([(0, 10), (16, 5), (21, 11)], 32)
    [shard] = shards.own_shards(optimizer)
    assert [(slot.start, slot.end) for slot in shard.slots] == [(0, 10), (16, 21), (21, 32)]
    assert shard.group_size is None  # stock: everything travels in the working dtype


# ---------------------------------------------------------------- a checkout's real version
def test_a_checkout_without_the_install_time_file_reports_its_version_txt(tmp_path):
    package = tmp_path / "DeepSpeed" / "deepspeed"
    package.mkdir(parents=True)
    (tmp_path / "DeepSpeed" / "version.txt").write_text("0.19.6\n")
    assert structure.real_version(package, "0.0.0") == "0.19.6"
    (package / "git_version_info_installed.py").write_text("version='0.19.8 '\n")
    assert structure.real_version(package, "0.19.8 ") == "0.19.8"  # installed: DeepSpeed's own
    assert seam_check.source_version(package) == "0.19.8"


# ---------------------------------------------------------------- the seam's preflight
@pytest.fixture(scope="module", params=["0.19.6", "0.19.8"])
def checkout(request) -> pathlib.Path:
    try:
        return sdist_checkout(request.param)
    except SdistUnavailable as why:
        pytest.skip(f"no DeepSpeed {request.param} source: {why}")


@pytest.mark.parametrize("subject", ["deepspeed", "deepspeed-native"])
def test_the_preflight_accepts_deepspeeds_own_sources(checkout, subject):
    assert seam_check.seam_problems(subject, checkout) == []
    found = seam_check.capabilities(checkout / "deepspeed")
    has_list = structure.OFFSETS in found.names
    assert has_list == (checkout.name == "DeepSpeed-0.19.8")  # 0.19.6 keeps no offsets list


def _copy_optimizer_source(checkout: pathlib.Path, root: pathlib.Path, edit) -> pathlib.Path:
    """`root`/deepspeed with `checkout`'s stage_1_and_2.py and base_optimizer.py, edited."""
    for relative in ("runtime/zero/stage_1_and_2.py", "runtime/base_optimizer.py"):
        target = root / "deepspeed" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkout / "deepspeed" / relative, target)
    path = root / "deepspeed" / seam_check.OPTIMIZER_FILE
    path.write_text(edit(path.read_text()))
    shutil.copyfile(checkout / "version.txt", root / "version.txt")
    return root


def test_the_preflight_refuses_a_deepspeed_without_what_the_seam_reads(checkout, tmp_path):
    def rename(text: str) -> str:
        return text.replace("self.real_dp_process_group =", "self.dp_process_groups =")

    root = _copy_optimizer_source(checkout, tmp_path, rename)
    [problem] = seam_check.seam_problems("deepspeed-native", root)
    assert "lacks DeepSpeedZeroOptimizer.real_dp_process_group" in problem
    version = (checkout / "version.txt").read_text().strip()
    assert f"DeepSpeed {version} (not a git checkout) from {root / 'deepspeed'}" in problem


def test_the_takeover_needs_the_gather_it_replaces(checkout, tmp_path):
    def no_gather(text: str) -> str:
        return text.replace("all_gather_dp_groups(", "gather_weights(")

    root = _copy_optimizer_source(checkout, tmp_path, no_gather)
    assert seam_check.seam_problems("deepspeed-native", root) == []  # native needs no takeover
    [problem] = seam_check.seam_problems("deepspeed", root)
    assert "does not call a module-level all_gather_dp_groups" in problem


def test_an_attribute_a_deepspeed_base_class_sets_counts(checkout, tmp_path):
    def to_base(text: str) -> str:  # a refactor that moves one assignment to the base class
        return text.replace("self.real_dp_process_group =", "real_dp_process_group_ =")

    root = _copy_optimizer_source(checkout, tmp_path, to_base)
    base = root / "deepspeed" / "runtime" / "base_optimizer.py"
    text = base.read_text()
    assert "class ZeROOptimizer(DeepSpeedOptimizer):" in text
    base.write_text(
        text.replace(
            "class ZeROOptimizer(DeepSpeedOptimizer):",
            "class ZeROOptimizer(DeepSpeedOptimizer):\n"
            "    def _groups(self):\n        self.real_dp_process_group = []\n",
        )
    )
    assert seam_check.seam_problems("deepspeed-native", root) == []


def test_a_deepspeed_that_is_not_there_is_named(tmp_path):
    [problem] = seam_check.seam_problems("deepspeed-native", tmp_path)
    assert "cannot read DeepSpeed" in problem and "stage_1_and_2.py" in problem


RACE = """
import sys
from tests.deepspeed_checkout import sdist_checkout, head
print(head(sdist_checkout(sys.argv[1])))
"""


def test_two_processes_asking_for_one_checkout_at_once_get_the_same_one(tmp_path):
    """pytest-xdist's two workers build the cached checkout at the same moment on a fresh
    machine (this unit module and tests/multigpu/test_qualify_checkouts.py): the second waits
    for the first and takes its checkout, instead of failing to rename over it."""
    try:
        archive = fetch_sdist("0.19.8")
    except SdistUnavailable as why:
        pytest.skip(f"no DeepSpeed 0.19.8 source: {why}")
    cache = tmp_path / "cache"
    (cache / "qwz" / "sdists" / "0.19.8").mkdir(parents=True)
    shutil.copy(archive, cache / "qwz" / "sdists" / "0.19.8" / archive.name)
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    root = pathlib.Path(__file__).resolve().parents[4]
    racers = [
        subprocess.Popen([sys.executable, "-c", RACE, "0.19.8"], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = [racer.communicate(timeout=600) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    assert results[0][0] == results[1][0] and len(results[0][0].strip()) == 40
    assert [p.name for p in (cache / "qwz" / "checkouts").iterdir() if p.is_dir()] == [
        "DeepSpeed-0.19.8"
    ]
