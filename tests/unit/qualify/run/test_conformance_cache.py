"""[Note: reused conformance tables] (qualify/run/conformance_cache.py): a table is reused only
for the same code, request and environment, and only where the caller asked for it."""

from __future__ import annotations

import json
import subprocess

import pytest

from qwz.qualify.run import conformance_cache, conformance_run

ROW = {
    "row": "stage1-omitted",
    "config": {"zero_optimization": {"stage": 1}},
    "ran": ["parse", "initialize"],
    "observed": "accepted",
    "refused_at": None,
    "message": None,
    "group_size": None,
}


class Tables:
    """A stand-in for the table's child process that counts how often it was asked."""

    def __init__(self, error: str | None = None):
        self.asked = 0
        self.error = error

    def __call__(self, subject, *, qwz_gather=True, deepspeed_src=None, cpu_quantizer=True):
        self.asked += 1
        rows = [] if self.error else [dict(ROW, message=None)]
        return {"parser": "p", "engine": "e", "rows": rows, "seconds": 1.5, "error": self.error}


@pytest.fixture
def tables(monkeypatch, tmp_path):
    monkeypatch.setenv(conformance_cache.CACHE_ENV, str(tmp_path / "cache"))
    asked = Tables()
    monkeypatch.setattr(conformance_run, "run_table", asked)
    return asked


def _git(root, *args):
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True,
    )  # fmt: skip


def _deepspeed_checkout(root):
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "one")
    return root


def test_unset_every_run_asks_its_subject(monkeypatch):
    monkeypatch.delenv(conformance_cache.CACHE_ENV, raising=False)
    asked = Tables()
    monkeypatch.setattr(conformance_run, "run_table", asked)
    for _ in range(2):
        section, reused = conformance_cache.table("qwz")
        assert reused is None and section["rows"]
    assert asked.asked == 2


def test_the_same_code_reuses_the_stored_table_unchanged(tables):
    first, reused = conformance_cache.table("qwz")
    assert reused is None and tables.asked == 1
    second, reused = conformance_cache.table("qwz")
    assert tables.asked == 1 and second == first
    assert reused is not None and json.loads(reused.read_text()) == first


def test_a_table_that_did_not_run_is_never_stored(monkeypatch, tmp_path):
    monkeypatch.setenv(conformance_cache.CACHE_ENV, str(tmp_path / "cache"))
    failing = Tables(error="could not start the table's process")
    monkeypatch.setattr(conformance_run, "run_table", failing)
    for _ in range(2):
        section, reused = conformance_cache.table("qwz")
        assert reused is None and section["error"]
    assert failing.asked == 2 and not list((tmp_path / "cache").glob("*"))


def test_a_stored_file_that_is_not_a_table_is_run_again_and_replaced(tables, tmp_path):
    conformance_cache.table("qwz")
    (stored,) = (tmp_path / "cache").glob("*.json")
    stored.write_text('{"rows": "not a table", "error": null}')
    section, reused = conformance_cache.table("qwz")
    assert reused is None and tables.asked == 2
    assert json.loads(stored.read_text()) == section


def test_qwz_s_own_uncommitted_change_is_another_key(tables, monkeypatch):
    from qwz.qualify.evidence import provenance, schema

    before = conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None)
    assert before is not None
    edited = schema.Head(repository="r", sha="a" * 40, dirty=True, diff_sha256="b" * 64)
    monkeypatch.setattr(provenance, "git_head", lambda: edited)
    assert conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None) != before
    unknown = schema.Head(repository="r", sha="unknown", dirty=False)
    monkeypatch.setattr(provenance, "git_head", lambda: unknown)
    assert conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None) is None


def test_the_request_and_the_environment_are_in_the_key(tables, monkeypatch):
    base = conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None)
    assert conformance_cache.key("qwz", qwz_gather=False, deepspeed_src=None) != base
    off = conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None, cpu_quantizer=False)
    assert off != base
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    assert conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None) != base
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.setenv("DS_SOMETHING", "1")
    assert conformance_cache.key("qwz", qwz_gather=True, deepspeed_src=None) != base


def test_a_deepspeed_checkout_s_commit_and_edit_are_in_the_key(tables, tmp_path):
    root = _deepspeed_checkout(tmp_path / "DeepSpeed")
    keys = [conformance_cache.key("deepspeed-native", qwz_gather=True, deepspeed_src=str(root))]
    (root / "deepspeed" / "runtime.py").write_text("x = 1\n")  # untracked: dirty
    keys.append(conformance_cache.key("deepspeed-native", qwz_gather=True, deepspeed_src=str(root)))
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "two")
    keys.append(conformance_cache.key("deepspeed-native", qwz_gather=True, deepspeed_src=str(root)))
    assert None not in keys and len(set(keys)) == 3


def test_an_installed_deepspeed_is_pinned_by_its_record(tmp_path):
    site = tmp_path / "site-packages"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("")
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (info / "RECORD").write_text("deepspeed/__init__.py,sha256=abc,0\n")
    first = conformance_cache.deepspeed_code([str(site)])
    (info / "RECORD").write_text("deepspeed/__init__.py,sha256=def,1\n")
    second = conformance_cache.deepspeed_code([str(site)])
    assert first is not None and second is not None and first != second
    assert first["version"] == "0.19.8"
    (info / "RECORD").unlink()  # neither a checkout nor an installed distribution
    assert conformance_cache.deepspeed_code([str(site)]) is None
    assert conformance_cache.deepspeed_code([str(tmp_path / "empty")]) is None
