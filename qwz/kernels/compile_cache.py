"""Inductor's compile cache, keyed per environment: every qwz ``torch.compile`` goes through
:func:`torch_compile`.

[Note: compile cache per environment]
Inductor's FX graph and AOTAutograd caches (under ``$TORCHINDUCTOR_CACHE_DIR``, default
``<tmp>/torchinductor_<user>``) key a compiled graph by the torch version, the device and
inductor's settings, but not by the vector capability ATen dispatches to
(``ATEN_CPU_CAPABILITY``, which inductor's C++ code generation also reads) nor by oneDNN's
ISA cap: a process capped at AVX2 loaded a graph compiled by a native AVX-512 process and
computed wrong values (a gradient norm of 2.21 instead of 2.97). Before qwz's first
``torch.compile`` (:func:`torch_compile`), :func:`compile_cache` appends a fingerprint of
everything that changes generated code or numerics (:func:`environment_facts`) to
``torch.compiler.config.cache_key_tag``, which both caches hash into every key (torch 2.13:
``FxGraphHashDetails.cache_key_tag``, inherited by ``AOTAutogradCacheDetails``). The tag is
read whenever a key is computed, so it also covers graphs compiled before qwz was imported,
and it keeps whatever directory the user chose: ``$TORCHINDUCTOR_CACHE_DIR`` is never
changed, only recorded (:class:`CompileCache`). Inductor's other caches are keyed by their
content (generated source, compiler command line with its ISA flags), and qwz's own native
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from qwz import native

logger = logging.getLogger("qwz")

ISA_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
)
"""Environment variables that cap or pick the vector instructions of ATen, inductor's C++
code, oneDNN or MKL."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment_facts() -> dict[str, str]:
    """What the code ``torch.compile`` generates, or the numbers it computes, depend on
    beyond what inductor keys itself: ATen's CPU capability, the ISA variables
    (:data:`ISA_ENV_VARS`), the CPU and its feature flags, torch (with its git revision),
    CUDA, Triton and Python versions. No CUDA call: the device's own properties are in
    inductor's key already."""
    facts = {
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "cpu_flags": " ".join(sorted(native.cpu_flags())),
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "python": sys.version.split()[0],
    }
    for name in ISA_ENV_VARS:
        facts[name] = os.environ.get(name, "").strip().lower()
    return facts


def environment_fingerprint(facts: dict[str, str] | None = None) -> str:
    """16 hex digits naming `facts` (default: :func:`environment_facts`)."""
    facts = environment_facts() if facts is None else facts
    text = "\0".join(f"{key}={facts[key]}" for key in sorted(facts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CompileCache(NamedTuple):
    """The inductor cache this process compiles into, and how its keys are made distinct."""

    directory: str
    """Inductor's cache directory (never changed by qwz)."""
    directory_source: str
    """``"TORCHINDUCTOR_CACHE_DIR"`` (set before qwz's first compile) or ``"inductor's
    default"``."""
    fingerprint: str
    """:func:`environment_fingerprint` of this process."""
    cache_key_tag: str
    """``torch.compiler.config.cache_key_tag`` after qwz appended the fingerprint."""


@functools.cache
def compile_cache() -> CompileCache:
    """Key inductor's caches by this environment (once per process, before qwz's first
    compile; see [Note: compile cache per environment]) and say which cache is in use."""
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    fingerprint = environment_fingerprint()
    marker = f"qwz-env-{fingerprint}"
    tag = torch.compiler.config.cache_key_tag
    if marker not in tag:
        tag = f"{tag}+{marker}" if tag else marker
        torch.compiler.config.cache_key_tag = tag
    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.abspath(cache_dir_utils.default_cache_dir())
    directory = default if explicit is None else os.path.abspath(explicit)
    cache = CompileCache(
        directory=directory,
        directory_source="inductor's default"
        if directory == default
        else "TORCHINDUCTOR_CACHE_DIR",
        fingerprint=fingerprint,
        cache_key_tag=tag,
    )
    logger.info("qwz: torch.compile cache %s (%s), keys tagged %s", *cache[:2], marker)
    return cache


def torch_compile(function: Callable, **options) -> Callable:
    """``torch.compile(function, **options)`` with the cache keyed first: every qwz kernel
    compiles through here."""
    compile_cache()
    return torch.compile(function, **options)
