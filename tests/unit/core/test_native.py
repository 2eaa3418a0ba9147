"""The native one-pass CPU wire kernels (``qwz/csrc/wire_kernels.c``, ``qwz/native.py``):
they write the eager kernels' bytes for every input and thread count, run on torch's
intra-op threads only where they share its OpenMP runtime, and their build cache never
hands out a library that does not load or was built for another CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qwz import kernels as wire_kernels
from qwz import native, quant
from qwz.kernels import EAGER_KERNELS
from qwz.kernels.fused import FusedDecode, FusedEncode
from qwz.quant import WireRow, row_codes, row_scales

from ..strategies import tensors

FLT_MAX = torch.finfo(torch.float32).max
POISON_BITS = (0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC0FFEE)
"""+-Inf, and NaNs of either sign, quiet and signalling, with other payloads (the scale
of a poisoned group is one NaN whatever NaN it holds)."""
POISONS = torch.tensor(POISON_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _has_compiler() -> bool:
    return any(c and shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc"))


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    """The process's native kernels. Skipped only where no C compiler exists; with one, a
    build or probe failure fails the test."""
    if not _has_compiler():
        pytest.skip("no C compiler ($CC, cc or gcc): the native kernels cannot be built here")
    loaded, reason = wire_kernels.native_kernels()
    assert loaded is not None, reason
    return loaded


def _rows(kernel_set, values, group_size, num_groups, world_size, rank, dtype):
    """Encode `values` into row `rank` of `world_size` wire rows (the others hold a fixed
    pattern), then decode all rows into a strided (world_size, numel) view of `dtype`."""
    row = WireRow(num_groups, group_size, 0, 2)
    rows = torch.arange(world_size * row.row_bytes, dtype=torch.int64).remainder(251)
    rows = rows.to(torch.uint8).view(world_size, -1)
    kernel_set.encode(values, row_scales(rows, row)[rank], row_codes(rows, row)[rank])
    # Row-strided destination, as DeepSpeed's partitions and qwz's working buffer give it.
    wide = torch.full((world_size, values.numel() + 3), -1.0, dtype=dtype)
    kernel_set.decode(row_scales(rows, row), row_codes(rows, row), wide[:, : values.numel()])
    return rows, wide


def _assert_same_decode(decoded: torch.Tensor, expected: torch.Tensor) -> None:
    """The same bytes wherever the value is a number; NaN at the same places (the cast of a
    NaN to bf16 may pick another payload; the wire bytes are compared exactly)."""
    nan = torch.isnan(decoded)
    assert torch.equal(nan, torch.isnan(expected))
    assert torch.equal(decoded[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))


@st.composite
def rows_to_encode(draw):
    """fp32 values for one wire row: group sizes with and without the G=64 fast path,
    group counts around the kernel's blocks of 16 groups, partial last groups and whole
    groups past the source's end, magnitudes from fp32's subnormals to its top, and
    sometimes a NaN (any payload) or an Inf."""
    group_size = draw(st.sampled_from([1, 8, 64, 100, 257, 1000]))
    num_groups = draw(st.sampled_from([1, 15, 16, 17, 40]))
    whole = num_groups * group_size
    numel = draw(st.sampled_from([whole, whole - 1, whole - 5, whole // 3, 1]))
    numel = max(1, min(whole, numel))
    exponents = draw(st.sampled_from([None, (-149, 126)]))
    x = draw(tensors(numel, torch.float32, exponents)).reshape(-1).contiguous()
    if draw(st.booleans()):
        x[draw(st.integers(0, numel - 1))] = POISONS[draw(st.integers(0, len(POISONS) - 1))]
    world_size = draw(st.sampled_from([1, 3]))
    rank = draw(st.integers(0, world_size - 1))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    return x, group_size, num_groups, world_size, rank, dtype


# Ties to even (scale 1: codes 2.5 -> 2, 3.5 -> 4), the top of fp32 (127 * scale would
# overflow: the scale is one ulp smaller), and scales below the smallest normal.
@example(
    case=(torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, -0.0, 1.5]), 8, 1, 1, 0, torch.float32)
)
@example(case=(torch.tensor([FLT_MAX, -FLT_MAX / 3, 1.0, 0.0]), 4, 1, 3, 2, torch.bfloat16))
@example(case=(torch.tensor([2.0**-149, 0.0, 2.0**-130, -(2.0**-126)]), 2, 2, 1, 0, torch.float32))
@given(case=rows_to_encode())
def test_native_and_eager_kernels_write_the_same_bytes(case, kernels):
    values, group_size, num_groups, world_size, rank, dtype = case
    rows, decoded = _rows(kernels, values, group_size, num_groups, world_size, rank, dtype)
    eager_rows, eager = _rows(
        EAGER_KERNELS, values, group_size, num_groups, world_size, rank, dtype
    )
    assert torch.equal(rows, eager_rows)
    _assert_same_decode(decoded, eager)
    # The columns past the destination view are never written.
    assert (decoded[:, values.numel() :] == -1).all()


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_fused_kernels_use_the_native_ones_only_where_they_serve(kernels, torch_threads):
    """CPU fp32 sources and bf16/fp32 destinations go native (at more than one torch thread
    only where the kernels share torch's OpenMP runtime); an fp16 destination or a
    non-contiguous source take the torch kernels -- the same bytes either way."""
    torch_threads(1)
    fused = wire_kernels.fused_kernels()
    assert isinstance(fused.encode.native, native.NativeKernels)
    assert isinstance(fused.decode.native, native.NativeKernels)
    row = WireRow(2, 64, 0, 2)
    rows = torch.zeros(1, row.row_bytes, dtype=torch.uint8)
    scales, codes = row_scales(rows, row), row_codes(rows, row)
    contiguous = torch.linspace(-2.0, 3.0, 96)
    source = torch.linspace(-2.0, 3.0, 64 * 3)[::2]  # 96 elements, not contiguous
    bf16_out = torch.zeros(1, 96, dtype=torch.bfloat16)
    assert kernels.can_encode(contiguous, scales[0], codes[0])
    assert kernels.can_decode(scales, codes, bf16_out)
    assert not kernels.can_encode(source, scales[0], codes[0])
    assert not kernels.can_decode(scales, codes, torch.zeros(1, 96, dtype=torch.float16))
    cases = [(source, torch.float16, 1), (contiguous, torch.bfloat16, 2)]
    for values, dtype, threads in cases:
        torch_threads(threads)
        if threads > 1:
            assert kernels.can_encode(contiguous, scales[0], codes[0]) == kernels.threaded
            assert kernels.can_decode(scales, codes, bf16_out) == kernels.threaded
        fused_rows, fused_out = _rows(fused, values, 64, 2, 1, 0, dtype)
        eager_rows, eager_out = _rows(EAGER_KERNELS, values, 64, 2, 1, 0, dtype)
        assert torch.equal(fused_rows, eager_rows)
        _assert_same_decode(fused_out, eager_out)


def test_the_kernels_run_on_torchs_threads_where_they_share_its_openmp_runtime(kernels):
    """With torch's wheel (an OpenMP intra-op pool, its libgomp.so.1, which the loader
    reuses for the library) the kernels use torch's threads."""
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert kernels.threaded, kernels.threading


def test_sharing_torchs_openmp_runtime_is_seen_through_the_thread_count(torch_threads):
    """The library shares torch's runtime when it sees the thread count torch sets; a
    runtime of its own (its own count) or no OpenMP (0) does not; torch's count is restored."""
    torch_threads(3)
    assert native.shares_torch_openmp(torch.get_num_threads)
    assert not native.shares_torch_openmp(lambda: 3)  # a runtime of its own, set to 3
    assert not native.shares_torch_openmp(lambda: 0)  # built without OpenMP
    assert torch.get_num_threads() == 3


def test_kernels_outside_torchs_openmp_runtime_stay_on_one_thread(
    kernels, torch_threads, monkeypatch
):
    """Where the library's OpenMP runtime is not torch's, or it was built without OpenMP, it
    runs on one thread and serves only where torch runs one: its threads would stall behind
    torch's spinning workers."""
    values, scales, codes = torch.zeros(64), torch.zeros(1), torch.zeros(64, dtype=torch.int8)
    for shares, openmp, why in [(False, True, "not torch's"), (True, False, "without OpenMP")]:
        monkeypatch.setattr(native, "shares_torch_openmp", lambda _, shares=shares: shares)
        single = native.NativeKernels(kernels.path, openmp)
        assert not single.threaded and why in single.threading
        torch_threads(2)
        assert single._threads() == 1
        assert not single.can_encode(values, scales, codes)
        torch_threads(1)
        assert single.can_encode(values, scales, codes)
    monkeypatch.setattr(native, "shares_torch_openmp", lambda _: True)
    assert native.NativeKernels(kernels.path, True).threaded


@st.composite
def threaded_rows(draw):
    """Rows large enough for the kernels' OpenMP team (65,536 elements and more): group
    sizes with and without the G=64 fast path, partial last blocks and groups."""
    group_size = draw(st.sampled_from([64, 100, 8192]))
    num_groups = -(-draw(st.integers(65_536, 300_000)) // group_size)
    numel = num_groups * group_size - draw(st.sampled_from([0, 1, group_size - 1, 17 * group_size]))
    values = torch.randn(max(1, numel), generator=torch.Generator().manual_seed(numel))
    values[draw(st.integers(0, values.numel() - 1))] = float("nan")
    return (
        values,
        group_size,
        num_groups,
        draw(st.sampled_from([1, 3])),
        draw(st.sampled_from([torch.bfloat16, torch.float32])),
    )


@settings(max_examples=12, deadline=None)
@given(case=threaded_rows(), threads=st.sampled_from([2, 3]))
def test_threaded_native_kernels_write_the_eager_kernels_bytes(case, threads, kernels):
    """Split over torch's threads, the encode and decode write the bytes of the eager
    kernels (one thread encodes a whole group, so the split cannot change them)."""
    if not kernels.threaded:
        pytest.skip(f"the native kernels run on one thread here: {kernels.threading}")
    values, group_size, num_groups, world_size, dtype = case
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, decoded = _rows(kernels, values, group_size, num_groups, world_size, 0, dtype)
    finally:
        torch.set_num_threads(before)
    eager_rows, eager = _rows(EAGER_KERNELS, values, group_size, num_groups, world_size, 0, dtype)
    assert torch.equal(rows, eager_rows)
    _assert_same_decode(decoded, eager)


def test_fused_kernels_call_the_native_ones_with_the_callers_tensors(kernels, torch_threads):
    """The dispatch itself: a gather's encode and decode reach the native entry points with
    the very tensors they were given (not the torch path)."""
    torch_threads(1)
    calls = []

    class Spy:
        can_encode = staticmethod(kernels.can_encode)
        can_decode = staticmethod(kernels.can_decode)

        def encode(self, *args):
            calls.append(("encode", *args))
            kernels.encode(*args)

        def decode(self, *args):
            calls.append(("decode", *args))
            kernels.decode(*args)

    def no_torch_compile(device, dtype):
        raise AssertionError("the torch path ran")

    fused = wire_kernels.QuantKernels(
        "fused",
        FusedEncode(Spy(), no_torch_compile),
        FusedDecode(Spy(), no_torch_compile),
    )
    values = torch.linspace(-2.0, 3.0, 64 * 17 - 5)
    rows, decoded = _rows(fused, values, 64, 17, 2, 1, torch.bfloat16)
    eager_rows, eager = _rows(EAGER_KERNELS, values, 64, 17, 2, 1, torch.bfloat16)
    assert torch.equal(rows, eager_rows)
    _assert_same_decode(decoded, eager)
    assert [call[0] for call in calls] == ["encode", "decode"]
    assert calls[0][1] is values
    # Nor was the torch.compile wrapper made: it costs a process dynamo's compiler imports.
    torch_paths = (fused.encode.scales, fused.encode.codes, fused.decode.kernel)
    assert all("fused" not in vars(kernel) for kernel in torch_paths)


def test_shapes_the_native_kernels_cannot_serve_take_the_torch_path(kernels, torch_threads):
    """Mismatched rows, overlapping destination rows, a source longer than the row and the
    wrong dtypes are not handed to C (which would write out of bounds); the torch kernels
    then raise their own errors."""
    torch_threads(1)
    scales, codes = torch.ones(3, 1), torch.ones(3, 4, dtype=torch.int8)
    assert kernels.can_decode(scales, codes, torch.zeros(3, 4))
    assert not kernels.can_decode(scales, codes, torch.zeros(3, 4)[:1])
    assert not kernels.can_decode(scales, codes, torch.zeros(4).expand(3, 4))
    assert not kernels.can_decode(scales, codes, torch.zeros(3, 5))
    assert not kernels.can_decode(scales.double(), codes, torch.zeros(3, 4))
    assert not kernels.can_decode(scales, codes.to(torch.uint8), torch.zeros(3, 4))
    scales_out, codes_out = torch.zeros(2), torch.zeros(16, dtype=torch.int8)
    assert kernels.can_encode(torch.zeros(16), scales_out, codes_out)
    assert not kernels.can_encode(torch.zeros(17), scales_out, codes_out)
    assert not kernels.can_encode(torch.zeros(16), scales_out.bfloat16(), codes_out)
    assert not kernels.can_encode(torch.zeros(16), scales_out, codes_out.to(torch.uint8))
    assert not kernels.can_encode(torch.zeros(16), torch.zeros(3), codes_out)
    # Groups of no elements (codes narrower than the scales) would divide by zero in C.
    empty_codes = torch.zeros(0, dtype=torch.int8)
    assert not kernels.can_encode(torch.zeros(0), torch.zeros(1), empty_codes)
    assert not kernels.can_decode(
        torch.ones(2, 3), torch.zeros(2, 0, dtype=torch.int8), torch.zeros(2, 0)
    )
    kernels.encode(torch.zeros(0), torch.zeros(1), empty_codes)  # and C returns, not SIGFPE
    kernels.decode(torch.ones(2, 3), torch.zeros(2, 0, dtype=torch.int8), torch.zeros(2, 0))


def test_fused_kernels_without_a_working_torch_compile_run_eager_logged(
    kernels, torch_threads, caplog
):
    """Where the native kernels cannot serve (here: an fp16 destination) and torch.compile
    does not work, the call runs eager (the same bytes), says so and records why."""
    torch_threads(1)

    def broken(device, dtype):
        return "InductorError: no C++ compiler"

    decode = FusedDecode(kernels, broken)
    fused = wire_kernels.QuantKernels("fused", FusedEncode(kernels, broken), decode)
    values = torch.linspace(-2.0, 3.0, 64 * 3)
    with caplog.at_level("WARNING", logger="qwz"):
        rows, decoded = _rows(fused, values, 64, 3, 2, 0, torch.float16)
    eager_rows, eager = _rows(EAGER_KERNELS, values, 64, 3, 2, 0, torch.float16)
    assert torch.equal(rows, eager_rows)
    _assert_same_decode(decoded, eager)
    assert "torch.compile unusable (InductorError: no C++ compiler)" in decode.fallback
    assert fused.encode.fallback is None  # the encode was served natively
    assert any("torch.compile unusable" in record.getMessage() for record in caplog.records)


# --------------------------------------------------------------------------- #
# Build, cache and probe
# --------------------------------------------------------------------------- #


def _load_afresh(caplog) -> native.NativeKernels:
    """native.load() past its per-process cache (and clearing it again), warnings captured."""
    native.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="qwz"):
            return native.load()
    finally:
        native.load.cache_clear()


def _assert_encodes_as_eager(loaded, values, group_size, num_groups) -> None:
    assert torch.equal(
        _rows(loaded, values, group_size, num_groups, 2, 1, torch.bfloat16)[0],
        _rows(EAGER_KERNELS, values, group_size, num_groups, 2, 1, torch.bfloat16)[0],
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QWZ_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.usefixtures("kernels")
def test_a_damaged_cached_library_is_rebuilt(cache_dir, caplog):
    path = native.build()
    path.write_bytes(b"\x7fELF truncated by a full disk")
    loaded = _load_afresh(caplog)
    assert loaded.path == path and path.read_bytes()[:4] == b"\x7fELF"
    assert path.stat().st_size > 1000
    assert any("fails to load" in record.getMessage() for record in caplog.records)
    _assert_encodes_as_eager(loaded, torch.linspace(-1.0, 1.0, 128), 64, 2)


@pytest.mark.usefixtures("kernels")
def test_the_cache_key_covers_the_cpu_and_the_source(cache_dir, monkeypatch):
    """-march=native code built on one CPU is never loaded on another: the library's name
    hashes the CPU's flags (and the source, the flags and the compiler)."""
    first = native.build()
    assert native.build() == first  # cached: not rebuilt
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2"})  # another machine
    other_cpu = native.build()
    assert other_cpu != first
    edited = cache_dir / "wire_kernels.c"
    edited.write_text(native.SOURCE.read_text() + "/* edited */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    assert native.build() not in (first, other_cpu)
    assert len(list(cache_dir.glob("qwz-wire-kernels-*.so"))) == 3
    assert not list(cache_dir.glob("*.tmp"))


def test_a_missing_compiler_is_named(cache_dir, monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match=r"no C compiler: set \$CC"):
        native.build()


def test_a_failing_compiler_is_named_and_leaves_no_library(cache_dir, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    with pytest.raises(native.NativeBuildError, match=r"false failed on wire_kernels.c"):
        native.build()
    assert not list(cache_dir.iterdir())


@pytest.mark.usefixtures("kernels")
def test_a_compiler_without_openmp_still_gives_one_thread_kernels(cache_dir, monkeypatch, caplog):
    """Where -fopenmp does not compile (a clang without libomp), the library is built
    without it, says so, and runs on one thread with the same bytes."""
    monkeypatch.setattr(native, "OPENMP_FLAGS", ("-fno-such-openmp-flag-qwz",))
    loaded = _load_afresh(caplog)
    assert not loaded.threaded and loaded.threading == "one thread (built without OpenMP)"
    assert any("without OpenMP" in record.getMessage() for record in caplog.records)
    assert [path.name for path in cache_dir.glob("*.so")] == [loaded.path.name]
    _assert_encodes_as_eager(loaded, torch.linspace(-1.0, 1.0, 64 * 20 - 3), 64, 20)


def test_native_kernels_that_write_other_bytes_are_refused(monkeypatch, caplog):
    """The self-test compares them with the eager kernels before any gather runs them; a
    mismatch (a miscompiled library) leaves the fused kernels on torch.compile, logged."""

    class Miscompiled:
        """Wrong only in whole blocks of 16 groups at G=64 (the main path)."""

        def encode(self, values, scales_out, codes_out):
            quant.encode_into(values, scales_out, codes_out)
            if scales_out.numel() >= 16 and codes_out.numel() == 64 * scales_out.numel():
                codes_out[0] = codes_out[0] ^ 1

        def decode(self, scales, codes, out):
            quant.decode_into(scales, codes, out)

    monkeypatch.setattr(native, "load", Miscompiled)
    wire_kernels.native_kernels.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="qwz"):
            loaded, reason = wire_kernels.native_kernels()
    finally:
        wire_kernels.native_kernels.cache_clear()
    assert loaded is None
    assert (
        "native kernels on cpu do not reproduce the eager kernels' bytes (eager on cpu: G=64"
        in (reason)
    )
    assert any("native wire kernels unavailable" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("kernels")
def test_an_unwritable_cache_dir_falls_back_to_a_temporary_one(tmp_path, monkeypatch):
    """A read-only home (some CI containers) still gets the native kernels: the library is
    built under the system's temporary directory instead."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("QWZ_CACHE_DIR", str(blocked / "qwz"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    path = native.build()
    assert path.parent == tmp_path / "tmp" / f"qwz-cache-{os.getuid()}"
    assert path.exists()


def test_a_shared_temporary_cache_dir_is_refused(tmp_path, monkeypatch):
    """The fallback under the temporary directory must be this user's and private: a
    library planted in a directory others can write would be loaded and run."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("QWZ_CACHE_DIR", str(blocked / "qwz"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"qwz-cache-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(native.NativeBuildError, match="not a private directory"):
        native.build()


@pytest.mark.usefixtures("kernels")
def test_a_cached_library_without_the_entry_points_is_removed_for_a_rebuild(cache_dir):
    """It loads (so this process keeps it under that name): the error names it, the file is
    removed, and the next build writes a library that has them."""
    path = native.build()
    empty = cache_dir / "empty.c"
    empty.write_text("int qwz_unrelated(void) { return 0; }\n")
    native._run([native._compiler(), "-shared", "-fPIC", str(empty), "-o", str(path)])
    native.load.cache_clear()
    try:
        with pytest.raises(native.NativeBuildError, match="lacks the kernels' entry points"):
            native.load()
    finally:
        native.load.cache_clear()
    assert not path.exists()
    assert native.build() == path
    check = "import ctypes, sys; ctypes.CDLL(sys.argv[1]).qwz_encode_f32"
    assert subprocess.run([sys.executable, "-c", check, str(path)]).returncode == 0
