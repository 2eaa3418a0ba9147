"""The test suite's compiler cache (tests/cxx_cache/g++, [Note: one op build per test run]):
a torch extension's source compiled in a second checkout is served from the cache, with
ninja's dependency file written as the compile writes it; a changed source, a changed flag
or another kind of compile is compiled."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

WRAPPER = pathlib.Path(__file__).resolve().parents[1] / "cxx_cache" / "g++"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")

COUNTING = """#!/bin/sh
case " $* " in *" -E "*) ;; *" -c "*) echo compile >> "{log}" ;; esac
exec {gxx} "$@"
"""


@pytest.fixture
def env(tmp_path):
    """PATH with a g++ that logs each real compile (not the wrapper's preprocessing)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    log = tmp_path / "compiles.log"
    (shim / "g++").write_text(COUNTING.format(log=log, gxx=shutil.which("g++")))
    (shim / "g++").chmod(0o755)
    path = os.pathsep.join([str(WRAPPER.parent), str(shim), os.environ["PATH"]])
    return dict(os.environ, PATH=path, QWZ_CXX_CACHE_DIR=str(tmp_path / "cache")), log


def checkout(root: pathlib.Path, value: int = 3) -> pathlib.Path:
    (root / "csrc" / "includes").mkdir(parents=True)
    (root / "csrc" / "includes" / "op.h").write_text(f"#define VALUE {value}\n")
    source = root / "csrc" / "op.cpp"
    source.write_text('#include "op.h"\nint value() { return VALUE; }\n')
    return source


def compile_op(env, source: pathlib.Path, build: pathlib.Path, *flags: str) -> pathlib.Path:
    build.mkdir(parents=True, exist_ok=True)
    root = source.parent.parent
    command = [
        str(WRAPPER), "-MMD", "-MF", "op.o.d", "-DTORCH_EXTENSION_NAME=op",
        f"-I{root}/csrc/includes", "-fPIC", "-O2", *flags, "-c", str(source), "-o", "op.o",
    ]  # fmt: skip
    subprocess.run(command, cwd=build, env=env[0], check=True)
    return build / "op.o"


def compiles(env) -> int:
    log = env[1]
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_the_same_op_in_a_second_checkout_is_served_from_the_cache(env, tmp_path):
    first = compile_op(env, checkout(tmp_path / "a"), tmp_path / "build-a")
    assert compiles(env) == 1
    second = compile_op(env, checkout(tmp_path / "b"), tmp_path / "build-b")
    assert compiles(env) == 1, "the second checkout's identical op was compiled again"
    assert second.read_bytes() == first.read_bytes()
    depfile = (tmp_path / "build-b" / "op.o.d").read_text()
    assert depfile.startswith("op.o:") and str(tmp_path / "b" / "csrc" / "op.cpp") in depfile
    assert str(tmp_path / "b" / "csrc" / "includes" / "op.h") in depfile


def test_a_changed_header_a_changed_flag_and_other_compiles_are_compiled(env, tmp_path):
    compile_op(env, checkout(tmp_path / "a"), tmp_path / "build-a")
    compile_op(env, checkout(tmp_path / "b", value=4), tmp_path / "build-b")
    assert compiles(env) == 2, "a different header was served from the cache"
    compile_op(env, tmp_path / "a" / "csrc" / "op.cpp", tmp_path / "build-c", "-O0")
    assert compiles(env) == 3, "a different flag was served from the cache"
    plain = tmp_path / "plain.cpp"
    plain.write_text("int plain() { return 1; }\n")
    for _ in range(2):  # not a torch extension: never cached
        subprocess.run([str(WRAPPER), "-c", str(plain), "-o", str(tmp_path / "plain.o")],
                       env=env[0], check=True)  # fmt: skip
    assert compiles(env) == 5


def test_a_failing_compile_fails_and_caches_nothing(env, tmp_path):
    source = checkout(tmp_path / "a")
    source.write_text("int broken( {\n")
    with pytest.raises(subprocess.CalledProcessError):
        compile_op(env, source, tmp_path / "build-a")
    assert not list((tmp_path / "cache").glob("*.o"))
