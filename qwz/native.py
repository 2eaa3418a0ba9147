"""The one-pass CPU wire kernels (``csrc/wire_kernels.c``): built with the C compiler on
first use, cached on disk, called through ctypes.

This module owns building and calling them; the numbers they compute are
[Note: quantization math] (quant.py), and qwz/kernels/ decides when they are used (its
self-test checks they write the eager kernels' bytes before any gather runs them).

[Note: native build]
The source is compiled with ``$CC`` (default ``cc``, then ``gcc``) and
``-O3 -march=native`` into ``$QWZ_CACHE_DIR`` (default ``~/.cache/qwz``; a per-user
directory under the system's temporary directory where that cannot be written), under a name
that hashes the source, the flags, the compiler's version and this CPU's feature flags: a
cache shared by machines with other CPUs never hands one of them code for the wrong
instructions. Ranks that build at once each write their own temporary file and rename it
into place, so a reader never sees half a library. ``-ffp-contract=off`` keeps every
product rounded as torch rounds it; no ``-ffast-math`` (NaN and Inf must behave as IEEE
says).

The source is built with ``-fopenmp`` (without it where the compiler rejects that flag;
then the kernels run on one thread). Each call splits its work over
``torch.get_num_threads()`` threads, but only where the library shares torch's OpenMP
runtime (:func:`shares_torch_openmp`: a thread count set through torch is the one the
library's OpenMP sees, as with torch's wheels, whose ``libgomp.so.1`` the loader reuses for
the library): then the kernels run on torch's own workers. With a runtime of their own their
threads would stall behind torch's workers spinning after each parallel region (each call
right after a parallel torch operation waits up to a scheduler tick for a core), so there
the kernels serve only where torch
runs one intra-op thread (every rank under torchrun, which sets ``OMP_NUM_THREADS=1``, or
under ``qwz.qualify.run.launch``) and the ``torch.compile`` kernels serve elsewhere. The bytes do
not depend on the thread count: one thread encodes a whole group.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "wire_kernels.c"
FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
)
ARCH_FLAGS = ("-march=native",)
OPENMP_FLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 120

logger = logging.getLogger("qwz")


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded here (the message says why)."""


class CompileError(NativeBuildError):
    """The compiler ran and rejected the source with these flags."""


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise NativeBuildError("no C compiler: set $CC or install cc/gcc")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """This CPU's feature flags (Linux ``flags``, ARM ``Features``), or none where `cpuinfo`
    cannot be read. What -march=native compiles for; the qualification's environment names
    some of them too (qwz/qualify/evidence/provenance.py)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _cache_dir() -> Path:
    if os.environ.get("QWZ_CACHE_DIR"):
        return Path(os.environ["QWZ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qwz"


def _writable(directory: Path) -> Path:
    """`directory`, created if missing; where it cannot be written (a read-only home), a
    per-user directory under the system's temporary directory instead, which must be this
    user's and writable by no one else (a library found there is loaded and run)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"qwz-cache-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    status = fallback.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise NativeBuildError(
            f"{fallback}: not a private directory of this user (owner uid {status.st_uid}, "
            f"mode {status.st_mode & 0o777:o}); set $QWZ_CACHE_DIR"
        )
    return fallback


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, errors="replace", timeout=BUILD_TIMEOUT_S
    )


def build(openmp: bool = True) -> Path:
    """Path of the built library (compiling it unless the cache holds it); raises
    NativeBuildError naming what failed. See [Note: native build]."""
    compiler = _compiler()
    version = _run([compiler, "--version"]).stdout
    flags = FLAGS + ARCH_FLAGS + (OPENMP_FLAGS if openmp else ())
    identity = [SOURCE.read_text(), " ".join(flags), compiler, version, platform.processor()]
    key = hashlib.sha256("\0".join([*identity, *sorted(cpu_flags())]).encode()).hexdigest()[:16]
    target = _writable(_cache_dir()) / f"qwz-wire-kernels-{key}.so"
    if target.exists():
        return target
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(handle)
    try:
        result = _run([compiler, *flags, str(SOURCE), "-o", temporary, "-lm"])
        if result.returncode != 0:
            raise CompileError(
                f"{Path(compiler).name} failed on {SOURCE.name} ({' '.join(flags)}): "
                f"{result.stderr.strip()[-500:]}"
            )
        os.chmod(temporary, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def shares_torch_openmp(max_threads: Callable[[], int]) -> bool:
    """Whether a library whose ``omp_get_max_threads`` is `max_threads` uses torch's OpenMP
    runtime: torch's thread count, changed for a moment, is what the library then sees (the
    count is the calling thread's setting in the runtime that holds it; torch's OpenMP
    backend sets it with ``omp_set_num_threads``). False where torch's pool is not OpenMP, the
    library has a runtime of its own, or it was built without OpenMP (0)."""
    before = torch.get_num_threads()
    probe = before + 1
    try:
        torch.set_num_threads(probe)
        return max_threads() == probe
    finally:
        torch.set_num_threads(before)


class NativeKernels:
    """The loaded library's two entry points, with argument checks done in Python."""

    def __init__(self, path: Path, openmp: bool):
        library = ctypes.CDLL(str(path))
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._encode = library.qwz_encode_f32
        self._encode.argtypes = [ptr, i64, i64, i64, ptr, ptr, c_int]
        self._encode.restype = None
        self._decode = library.qwz_decode
        self._decode.argtypes = [ptr, i64, ptr, i64, ptr, i64, c_int, i64, i64, i64, i64, c_int]
        self._decode.restype = None
        self.path = path
        max_threads = library.qwz_openmp_max_threads
        max_threads.argtypes, max_threads.restype = [], c_int
        self.threaded = openmp and shares_torch_openmp(max_threads)
        """Whether calls use torch's intra-op threads: built with OpenMP, and the library's
        OpenMP runtime is torch's (see [Note: native build])."""
        self.threading = (
            "torch's intra-op threads (OpenMP)"
            if self.threaded
            else "one thread (built without OpenMP)"
            if not openmp
            else "one thread (its OpenMP runtime is not torch's)"
        )

    def _threads(self) -> int:
        """Threads a call runs on: torch's count where the kernels share its runtime, else 1
        (and then they serve only at one torch thread)."""
        return torch.get_num_threads() if self.threaded else 1

    def can_encode(
        self, values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor
    ) -> bool:
        """Whether :meth:`encode` serves these tensors: CPU, torch's threads usable (see
        [Note: native build]), a contiguous fp32 source of at most U * G elements, contiguous
        fp32 scales (U,) and int8 codes (U * G,)."""
        return (
            values.device.type == scales_out.device.type == codes_out.device.type == "cpu"
            and (self.threaded or torch.get_num_threads() == 1)
            and values.dtype == torch.float32
            and scales_out.dtype == torch.float32
            and codes_out.dtype == torch.int8
            and values.dim() == scales_out.dim() == codes_out.dim() == 1
            and values.is_contiguous()
            and scales_out.is_contiguous()
            and codes_out.is_contiguous()
            and scales_out.numel() > 0
            and codes_out.numel() >= scales_out.numel()
            and codes_out.numel() % scales_out.numel() == 0
            and values.numel() <= codes_out.numel()
        )

    def can_decode(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether :meth:`decode` serves these tensors: CPU, torch's threads usable, fp32
        scales (W, U) and int8 codes (W, U * G) with unit element stride, and a bf16 or fp32
        destination (W, n <= U * G) whose rows are unit-stride and do not overlap (the rows
        themselves may be strided)."""
        return (
            scales.device.type == codes.device.type == out.device.type == "cpu"
            and (self.threaded or torch.get_num_threads() == 1)
            and scales.dtype == torch.float32
            and codes.dtype == torch.int8
            and out.dtype in (torch.bfloat16, torch.float32)
            and scales.dim() == codes.dim() == out.dim() == 2
            and scales.shape[0] == codes.shape[0] == out.shape[0]
            and scales.shape[1] > 0
            and codes.shape[1] >= scales.shape[1]
            and codes.shape[1] % scales.shape[1] == 0
            and out.shape[1] <= codes.shape[1]
            and scales.stride(1) == 1
            and codes.stride(1) == 1
            and out.stride(1) == 1
            and (out.shape[0] == 1 or out.stride(0) >= out.shape[1])
        )

    def encode(self, values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor):
        """:func:`qwz.quant.encode_into` for tensors :meth:`can_encode` accepts."""
        num_groups = scales_out.shape[0]
        self._encode(
            values.data_ptr(),
            values.numel(),
            num_groups,
            codes_out.shape[0] // num_groups,
            scales_out.data_ptr(),
            codes_out.data_ptr(),
            self._threads(),
        )

    def decode(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
        """:func:`qwz.quant.decode_into` for tensors :meth:`can_decode` accepts."""
        rows, num_groups = scales.shape
        self._decode(
            scales.data_ptr(),
            scales.stride(0),
            codes.data_ptr(),
            codes.stride(0),
            out.data_ptr(),
            out.stride(0),
            int(out.dtype == torch.bfloat16),
            rows,
            num_groups,
            codes.shape[1] // num_groups,
            out.shape[1],
            self._threads(),
        )


@functools.cache
def load() -> NativeKernels:
    """The native kernels, built on first call (raises NativeBuildError); with OpenMP where
    the compiler has it, else without (logged). A cached library that does not load
    (truncated, damaged) is removed and built again, once; one that loads but lacks the
    entry points is removed for the next process to rebuild (this process cannot load
    another file under the same name) and NativeBuildError is raised."""
    try:
        try:
            path, openmp = build(openmp=True), True
        except CompileError as error:  # e.g. a clang without libomp
            logger.warning("qwz: native kernels build without OpenMP (%s)", error)
            path, openmp = build(openmp=False), False
        try:
            return NativeKernels(path, openmp)
        except AttributeError as error:
            path.unlink(missing_ok=True)
            raise NativeBuildError(
                f"cached {path.name} lacks the kernels' entry points ({error}); removed, "
                "the next process rebuilds it"
            ) from error
        except OSError as error:
            logger.warning("qwz: cached %s fails to load (%s); rebuilding", path, error)
            path.unlink(missing_ok=True)
            return NativeKernels(build(openmp), openmp)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{type(error).__name__}: {error}") from error
