"""The wire kernels a gather runs, one file per job:

- ``fused.py``: the kernels themselves (:class:`QuantKernels`, the eager ones and the fused
  ones: native C on CPU where they serve, else ``torch.compile``);
- ``self_tests.py``: fused kernels must write the eager kernels' bytes, checked before they
  serve;
- ``compile_cache.py``: inductor's cache keyed per environment
  ([Note: compile cache per environment]), the one door to ``torch.compile``;
- ``choice.py``: the process's fused kernels and the choice between them and eager.

Each imports only the ones listed above it; this file re-exports the names the rest of qwz
uses, so ``from qwz.kernels import X`` is the public seam.
"""

from qwz.kernels.choice import (
    KernelChoice,
    choose_kernels,
    fused_available,
    fused_kernels,
    kernel_fallbacks,
    native_kernels,
    self_test,
)
from qwz.kernels.compile_cache import (
    ISA_ENV_VARS,
    CompileCache,
    compile_cache,
    environment_facts,
    environment_fingerprint,
    torch_compile,
)
from qwz.kernels.fused import EAGER_KERNELS, QuantKernels
from qwz.kernels.self_tests import (
    EXTREMES_GROUP_SIZE,
    NATIVE_SELF_TEST_ROWS,
    RAMP_ROWS,
    KernelComparison,
    KernelMismatch,
    compare_with_eager,
    extreme_values,
    ramp_values,
    self_test_on,
)

__all__ = [
    "EAGER_KERNELS",
    "EXTREMES_GROUP_SIZE",
    "ISA_ENV_VARS",
    "NATIVE_SELF_TEST_ROWS",
    "RAMP_ROWS",
    "CompileCache",
    "KernelChoice",
    "KernelComparison",
    "KernelMismatch",
    "QuantKernels",
    "choose_kernels",
    "compare_with_eager",
    "compile_cache",
    "environment_facts",
    "environment_fingerprint",
    "extreme_values",
    "fused_available",
    "fused_kernels",
    "kernel_fallbacks",
    "native_kernels",
    "ramp_values",
    "self_test",
    "self_test_on",
    "torch_compile",
]
