"""``--deepspeed-src``: the DeepSpeed checkout a run imports, and the identity it binds
([Note: subject identity], qualify/run/subjects.py; qualify/evidence/provenance.py ``subject()``).

Each test imports deepspeed in a subprocess (the test process may hold another one)
from a copy of the installed package in a temporary git repository
(tests/deepspeed_checkout.py)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from qwz.qualify.evidence import ledger
from qwz.qualify.evidence.schema import Head, Subject
from qwz.qualify.run import subjects
from tests import warm_python
from tests.deepspeed_checkout import git, head, make_checkout

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

WORKTREE = pathlib.Path(__file__).resolve().parents[4]
IDENTITY = """
import json, sys
from qwz.qualify.evidence import provenance
from qwz.qualify.run import subjects
subjects.use_deepspeed_source(sys.argv[1] if len(sys.argv) > 1 else None)
print("IDENTITY " + json.dumps(provenance.code_under_test("deepspeed-native")))
"""


def _python(code: str, *args: str, pythonpath: str = str(WORKTREE)):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    return warm_python.run(["-c", code, *args], env=env, timeout=600)


def identity(top: pathlib.Path, flag: bool = True) -> dict:
    """The identity a run binds with ``--deepspeed-src top`` (`flag`), or with `top` on
    the import path and no flag, as an editable install (``pip install -e top``) puts it."""
    if flag:
        done = _python(IDENTITY, str(top))
    else:
        done = _python(IDENTITY, pythonpath=f"{top}{os.pathsep}{WORKTREE}")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("IDENTITY "))
    return json.loads(line.removeprefix("IDENTITY "))


def ledger_key(found: dict) -> dict:
    return ledger.code_identity(
        Subject(**found["subject"]), Head(**found["head"]), Head(**found["harness"])
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> pathlib.Path:
    """Stock DeepSpeed whose install-time record names another commit (as a wheel built
    from a checkout at 1111111 would)."""
    top = make_checkout(tmp_path_factory.mktemp("deepspeed"))
    info = top / "deepspeed" / "git_version_info_installed.py"
    text = info.read_text().replace("git_hash='unknown'", "git_hash='1111111'")
    info.write_text(text)
    git(top, "commit", "-q", "-am", "install-time commit 1111111")
    return top


def test_a_clean_checkout_binds_its_live_commit(checkout):
    found = identity(checkout)
    subject = found["subject"]
    assert subject["name"] == "deepspeed-native" and subject["version"].startswith("0.19")
    assert subject["sha"] == head(checkout) and subject["dirty"] is False
    assert subject["diff_sha256"] is None
    assert subject["installed_commit"] == "1111111"  # context, never the identity
    assert subject["import_path"] == str(checkout.resolve() / "deepspeed")
    assert found["head"]["sha"] == head(checkout) and found["head"]["dirty"] is False
    assert found["head"]["path"] == str(checkout.resolve())
    assert found["harness"]["path"] == str(WORKTREE)  # qwz's own head, kept apart
    assert identity(checkout, flag=False) == found  # an editable install: the same


def test_an_uncommitted_edit_is_dirty_with_its_own_digest_and_ledger_key(checkout):
    clean = identity(checkout)
    engine = checkout / "deepspeed" / "runtime" / "engine.py"
    original = engine.read_text()
    try:
        engine.write_text(original + "\n# an uncommitted edit\n")
        edited = identity(checkout)
        engine.write_text(original + "\n# another uncommitted edit\n")
        other = identity(checkout)
    finally:
        engine.write_text(original)
    assert edited["subject"]["sha"] == clean["subject"]["sha"]
    assert edited["subject"]["dirty"] is True and edited["head"]["dirty"] is True
    digests = {edited["subject"]["diff_sha256"], other["subject"]["diff_sha256"]}
    assert len(digests) == 2 and None not in digests
    keys = [json.dumps(ledger_key(item), sort_keys=True) for item in (clean, edited, other)]
    assert len(set(keys)) == 3
    assert identity(checkout)["subject"]["dirty"] is False  # reverted: clean again


def test_an_untracked_source_file_is_dirty_and_byte_code_is_not(checkout):
    added = checkout / "deepspeed" / "runtime" / "new_module.py"
    byte_code = checkout / "deepspeed" / "runtime" / "__pycache__" / "new.cpython-311.pyc"
    byte_code.parent.mkdir(exist_ok=True)
    byte_code.write_bytes(b"not source")
    assert identity(checkout)["subject"]["dirty"] is False
    try:
        added.write_text("VALUE = 1\n")
        assert identity(checkout)["subject"]["dirty"] is True
    finally:
        added.unlink()
    assert identity(checkout)["subject"]["dirty"] is False


def test_two_commits_of_one_version_are_two_identities(checkout, tmp_path):
    other = make_checkout(tmp_path, patch=SECOND_COMMIT)
    first, second = identity(checkout), identity(other)
    assert first["subject"]["version"] == second["subject"]["version"]
    assert first["subject"]["sha"] != second["subject"]["sha"]
    assert ledger_key(first) != ledger_key(second)


SECOND_COMMIT = """\
diff --git a/deepspeed/second_commit.txt b/deepspeed/second_commit.txt
new file mode 100644
--- /dev/null
+++ b/deepspeed/second_commit.txt
@@ -0,0 +1 @@
+a second commit of the same version
"""


def test_deepspeed_imported_from_elsewhere_is_refused(checkout):
    """A rank that already holds the installed deepspeed cannot qualify the checkout."""
    code = (
        "import deepspeed\n"
        "from qwz.qualify.run import subjects\n"
        "try:\n"
        "    subjects.use_deepspeed_source(sys.argv[1])\n"
        "except subjects.DeepSpeedSourceError as error:\n"
        "    print('REFUSED', error)\n"
    )
    done = _python("import sys\n" + code, str(checkout))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED --deepspeed-src" in done.stdout
    assert f"not from under {checkout.resolve()}" in done.stdout


def test_the_preflight_names_deepspeeds_refusal_its_version_and_commit(checkout):
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2, "zero_quantized_weights": True},
    }
    assert subjects.deepspeed_native_problems(str(checkout), {"candidate-g64": config}) == []
    config["zero_optimization"]["zero_quantized_weights_group_size"] = 8192
    [problem] = subjects.deepspeed_native_problems(str(checkout), {"candidate-g8192": config})
    assert "refuses the config of arm 'candidate-g8192'" in problem
    assert "zero_quantized_weights_group_size Extra inputs are not permitted" in problem
    assert f"DeepSpeed 0.19.8 at {head(checkout)[:12]} from {checkout.resolve()}" in problem


def test_a_path_without_deepspeed_is_refused(tmp_path):
    [problem] = subjects.deepspeed_native_problems(str(tmp_path), {})
    assert "no deepspeed/__init__.py there" in problem
