"""A DeepSpeed-shaped repository for the review's run of a PR's own tests ([Note: the PR's own
tests] in qwz/qualify/pr_review/own_tests.py), built in the test.

DeepSpeed's source distribution has no ``tests/``, so the repository carries a small test
harness of its own in DeepSpeed's layout: ``tests/conftest.py`` with DeepSpeed's hook that
hands a ``DistributedTest`` to its own launcher, and ``tests/unit/common.py`` whose
``DistributedTest`` spawns its ranks as DeepSpeed's does (a ``torch.multiprocessing`` pool
started with ``forkserver``, each rank's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``LOCAL_RANK``/
``WORLD_SIZE`` set, a gloo
(NCCL with a GPU per rank) process group on a file store through ``deepspeed.init_distributed``,
a skip where there are fewer GPUs than ranks, a rank's skip raised
as the test's, ``pytest.exit("Test hanged, exiting")`` past its own timeout, and the skip
"only supported in accelerator environments." for a test that needs one where there is none).
``deepspeed/__init__.py`` says which commit it is (``version``), so a test knows the head's
DeepSpeed was the one imported.

``main`` is the base: the harness and ``tests/unit/test_existing.py``. Branches on top:
``passing`` (the head's version, a changed ``test_existing.py``, a new file with a CPU test and
a two-rank test, a new file whose test needs an accelerator), ``broken`` (the head's version,
``passing``'s ``test_existing.py`` with its new test broken, and a test file that does not
import; small, so its review costs seconds), ``hangs`` (``passing`` and a test that never
ends, after starting a child process).
"""

from __future__ import annotations

import pathlib

from tests.deepspeed_checkout import git

CONFTEST = '''\
"""A stand-in for DeepSpeed's tests/conftest.py: its hook that runs a DistributedTest."""
import os
import sys

import pytest

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if getattr(item.cls, "is_dist_test", False):
        dist_test_class = item.cls()
        dist_test_class(item._request)
        item.runtest = lambda: True
'''

COMMON = '''\
"""A stand-in for DeepSpeed's tests/unit/common.py: DistributedTest spawns its ranks."""
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from _pytest.outcomes import Skipped

import deepspeed


class DistributedTest:
    is_dist_test = True
    world_size = 2
    requires_cuda_env = True
    exec_timeout = 600

    def __call__(self, request):
        self._current_test = getattr(self, request.function.__name__)
        if self.requires_cuda_env and not torch.cuda.is_available():
            pytest.skip("only supported in accelerator environments.")
        if torch.cuda.is_available() and torch.cuda.device_count() < self.world_size:
            pytest.skip(f"Skipping test because not enough GPUs are available: {self.world_size} "
                        f"required, {torch.cuda.device_count()} available")
        tmpdir = request.getfixturevalue("tmpdir")
        with tempfile.NamedTemporaryFile(delete=False, dir=str(tmpdir)) as store:
            init_method = f"file://{store.name}"
        with socket.socket() as free:
            free.bind(("", 0))
            master_port = str(free.getsockname()[1])
        mp.set_start_method("forkserver", force=True)
        pool = mp.Pool(processes=self.world_size)
        ranks = [(rank, master_port, init_method) for rank in range(self.world_size)]
        try:
            skips = pool.starmap_async(self._dist_run, ranks).get(self.exec_timeout)
        except mp.TimeoutError:
            pytest.exit("Test hanged, exiting", returncode=1)
        finally:
            pool.terminate()
            pool.join()
        if any(skips):
            pytest.skip(skips[0])

    def _dist_run(self, rank, master_port, init_method):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port, RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_SIZE=str(self.world_size))
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank)
            backend = "nccl"
        deepspeed.init_distributed(
            dist_backend=backend, init_method=init_method, rank=rank, world_size=self.world_size
        )
        try:
            self._current_test()
        except Skipped as skipped:
            return skipped.msg
        finally:
            torch.distributed.destroy_process_group()
        return ""
'''


HARNESS = {
    "tests/conftest.py": CONFTEST,
    "tests/unit/__init__.py": "",
    "tests/unit/common.py": COMMON,
}
"""DeepSpeed's test harness in small: what a head's own tests run under."""


def deepspeed_init(version: str) -> str:
    return f'''\
version = "{version}"


def init_distributed(dist_backend=None, init_method=None, rank=-1, world_size=-1):
    import torch.distributed

    torch.distributed.init_process_group(
        dist_backend, init_method=init_method, rank=rank, world_size=world_size
    )
'''


EXISTING_AT_BASE = """\
import deepspeed


def test_version_exists():
    assert isinstance(deepspeed.version, str)
"""

EXISTING_AT_HEAD = (
    EXISTING_AT_BASE
    + """

def test_version_is_head():
    assert deepspeed.version == "head"
"""
)

HEAD_VERSION = """\
import os

import deepspeed
import torch
import torch.distributed as dist
from unit.common import DistributedTest


def test_the_heads_deepspeed_is_imported():
    assert deepspeed.version == "head"


class TestAllReduce(DistributedTest):
    world_size = 2
    requires_cuda_env = False

    def test_sums_over_ranks(self):
        assert deepspeed.version == "head" and os.environ["WORLD_SIZE"] == "2"
        total = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(total)
        assert total.item() == 3
"""

NEEDS_GPU = """\
import torch
from unit.common import DistributedTest


class TestOnTwoGpus(DistributedTest):
    world_size = 2

    def test_sees_a_gpu(self):
        assert torch.cuda.is_available()
"""

DOES_NOT_IMPORT = """\
from deepspeed.runtime.zero.no_such_module import quantized_gather


def test_gather():
    assert quantized_gather is not None
"""

HANGS = """\
import os
import subprocess
import time


def test_waits_for_a_reply_that_never_comes():
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["QWZ_TEST_CHILD_PID_FILE"], "w") as pid_file:
        pid_file.write(str(child.pid))
    time.sleep(600)
"""

BASE_FILES = {
    "deepspeed/__init__.py": deepspeed_init("base"),
    **HARNESS,
    "tests/unit/test_existing.py": EXISTING_AT_BASE,
    ".gitignore": "__pycache__/\n*.pyc\n",
}
PASSING = {
    "deepspeed/__init__.py": deepspeed_init("head"),
    "tests/unit/test_existing.py": EXISTING_AT_HEAD,
    "tests/unit/test_head_version.py": HEAD_VERSION,
    "tests/unit/test_needs_gpu.py": NEEDS_GPU,
}
BROKEN = {
    "deepspeed/__init__.py": deepspeed_init("head"),
    "tests/unit/test_existing.py": EXISTING_AT_HEAD.replace('== "head"', '== "HEAD"'),
    "tests/unit/test_does_not_import.py": DOES_NOT_IMPORT,
}
HANGING = {"tests/unit/test_hangs.py": HANGS}
BROKEN_TEST = "tests/unit/test_existing.py::test_version_is_head"
"""The own test ``broken`` breaks (``passing``'s, with "HEAD" for "head")."""


def _commit(root: pathlib.Path, files: dict[str, str], message: str) -> str:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD").strip()


def make_repository(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """The repository (module docstring), checked out at the base as a user's would be; its
    root and the SHA of each branch (``main``, ``passing``, ``broken``, ``hangs``)."""
    root = tmp_path / "DeepSpeed"
    root.mkdir(parents=True)
    git(root, "init", "-q")
    shas = {"main": _commit(root, BASE_FILES, "base: the harness and one test")}
    for name, parent, files in (
        ("passing", "main", PASSING),
        ("broken", "main", BROKEN),
        ("hangs", "passing", HANGING),
    ):
        git(root, "checkout", "-q", "-b", name, parent)
        shas[name] = _commit(root, files, name)
    git(root, "checkout", "-q", "main")
    return root, shas


PROPOSAL_TEST_PATH = "tests/unit/runtime/zero/test_zero_quantized_weights_stage12.py"
PROPOSAL_TEST = '''\
"""The proposal's own tests: its config rules, its group size on two ranks, and a GPU case."""
import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from unit.common import DistributedTest


def _zero(**keys):
    return DeepSpeedZeroConfig(stage=2, zero_quantized_weights=True, **keys)


def test_the_group_size_defaults_to_64():
    assert _zero().zero_quantized_weights_group_size == 64


@pytest.mark.parametrize("group_size", [12, 100])
def test_a_group_size_not_a_multiple_of_8_is_refused(group_size):
    with pytest.raises(ValueError, match="multiple of 8"):
        _zero(zero_quantized_weights_group_size=group_size)


class TestEveryRankReadsTheGroupSize(DistributedTest):
    world_size = 2
    requires_cuda_env = False

    def test_on_two_ranks(self):
        size = _zero(zero_quantized_weights_group_size=8192).zero_quantized_weights_group_size
        total = torch.tensor([float(size)])
        dist.all_reduce(total)
        assert total.item() == 2 * 8192


class TestOnTwoGpus(DistributedTest):
    world_size = 2

    def test_sees_its_gpu(self):
        assert torch.cuda.current_device() == dist.get_rank()
'''
"""An own test the proposal's head adds (tests/multigpu/test_qualify_review.py): on a CPU
runner four cases pass and the GPU case is skipped with its reason."""
PROPOSAL_TEST_BROKEN = PROPOSAL_TEST.replace(
    "zero_quantized_weights_group_size == 64", "zero_quantized_weights_group_size == 128"
)
PROPOSAL_BROKEN_TEST = f"{PROPOSAL_TEST_PATH}::test_the_group_size_defaults_to_64"
"""The proposal's own test ``PROPOSAL_TEST_BROKEN`` breaks."""
