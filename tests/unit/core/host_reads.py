"""A counter of host reads of tensor values, and a tiny engine run that it watches.

On a GPU every read of a tensor's value by the host -- ``.item()``, ``float()``, ``bool()``
(an ``if`` on a tensor), ``.tolist()``, ``.numpy()``, ``.cpu()``, an f-string of a tensor,
and every op whose output size depends on the data (``nonzero``, a boolean mask index,
``unique``, ...) -- waits for the device to finish all the work queued before it. On the
CPU nothing waits, but the same calls are made, so a CPU run counts the syncs a GPU run
would pay. :class:`HostReads` (a ``TorchFunctionMode``: it sees every such call made
from Python, however it is spelt) records each one with the code that made it:

* ``qwz`` -- the engine's own code (qwz/, not the harness in qwz/qualify/): what the
  tests assert on, read by read;
* ``torch`` -- calls made inside torch itself (torch.optim reads its step counters, which
  live on the CPU even beside GPU parameters for the non-capturable optimizers qwz builds):
  kept apart, and checked to be those counters.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import qwz

REPO = pathlib.Path(qwz.__file__).resolve().parent.parent
QWZ_DIR = REPO / "qwz"
HARNESS_DIR = QWZ_DIR / "qualify"
TORCH_DIR = pathlib.Path(torch.__file__).resolve().parent
DISPATCH_FILES = {TORCH_DIR / "overrides.py", TORCH_DIR / "_tensor.py", pathlib.Path(__file__)}
"""Frames between a call and this mode that belong to the call itself (torch's Python
wrappers of Tensor methods, the dispatch to the mode, this file)."""

SCALAR_READS = frozenset(
    {
        "item",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "is_nonzero",
        "tolist",
        "numpy",
        "__array__",
        "__format__",
        "__repr__",
        "cpu",
        "equal",
        "allclose",
    }
)
"""Calls that always bring a value to the host."""
DATA_DEPENDENT = frozenset(
    {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "nonzero_static"}
)
"""Ops whose output size depends on the data: the host reads it before allocating."""


class Read(NamedTuple):
    where: str
    """``path:function`` of the code that made the call (path relative to the repository
    or to torch's package)."""
    what: str
    """The call, by name (``__bool__``, ``item``, ``nonzero``, ...)."""
    origin: str
    """``qwz``, ``torch`` or ``other`` (see the module docstring)."""
    tensor_id: int | None
    """``id`` of the tensor read (its first tensor argument), for :meth:`HostReads.torch_reads`."""


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


def _syncing(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SCALAR_READS or name in DATA_DEPENDENT:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        return len(args) > 1 and _bool_index(args[1])
    if name == "repeat_interleave":  # tensor repeats without output_size: a read of their sum
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "to":  # to the CPU (a device-to-host copy on a GPU)
        targets = [*args[1:], kwargs.get("device")]
        return any(
            (isinstance(t, str) and t.startswith("cpu"))
            or (isinstance(t, torch.device) and t.type == "cpu")
            for t in targets
        )
    return False


def _caller() -> tuple[str, str]:
    """(``path:function``, origin) of the first frame outside :data:`DISPATCH_FILES`."""
    frame = sys._getframe(2)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if path not in DISPATCH_FILES:
            break
        frame = frame.f_back
    if frame is None:
        return "?", "other"
    name = frame.f_code.co_name
    if path.is_relative_to(TORCH_DIR):
        return f"torch/{path.relative_to(TORCH_DIR)}:{name}", "torch"
    if path.is_relative_to(QWZ_DIR) and not path.is_relative_to(HARNESS_DIR):
        return f"{path.relative_to(REPO)}:{name}", "qwz"
    return f"{path.name}:{name}", "other"


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor value made while active (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[Read] = []
        self.counting = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.counting and _syncing(name, args, kwargs):
            where, origin = _caller()
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.reads.append(Read(where, name, origin, None if tensor is None else id(tensor)))
        return func(*args, **kwargs)

    def qwz_reads(self) -> list[tuple[str, str]]:
        """(where, what) of every read qwz's own code made, in order."""
        return [(read.where, read.what) for read in self.reads if read.origin == "qwz"]

    def torch_reads(self) -> list[Read]:
        return [read for read in self.reads if read.origin == "torch"]


GRADIENT_FINITE = ("qwz/optimizer.py:_update", "__bool__")
"""[Note: host reads in a step], read 1: is the reduced gradient norm finite (whether the
torch optimizer steps; fp16: what ``engine.step()`` returns, and the loss scale's move)."""
MASTERS_IN_RANGE = ("qwz/optimizer.py:check_updated_masters", "__bool__")
"""[Note: host reads in a step], read 2: are the updated masters within the working dtype's
range (before the gather writes any working copy)."""


class TinyNet(torch.nn.Module):
    """Two quantizable weights (160, 120 elements) and small exact parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 20)
        self.norm = torch.nn.LayerNorm(20)
        self.head = torch.nn.Linear(20, 6)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.up(inputs))))


def engine_config(dtype: str, stage: int, accumulation: int = 1) -> dict[str, Any]:
    """A quantized config whose gather spans several chunks (a bucket of 48 elements), with
    clipping, so every phase of a step runs."""
    config: dict[str, Any] = {
        "zero_optimization": {
            "stage": stage,
            "zero_quantized_weights": True,
            "zero_quantized_weights_group_size": 8,
            "zero_quantized_weights_preserve_numel": 32,
            "allgather_bucket_size": 48,
            "reduce_bucket_size": 64,
        },
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return config


class StepReads(NamedTuple):
    """What one optimizer step (its micro-batches' backward and step) read on the host."""

    stepped: bool
    qwz: list[tuple[str, str]]


def run_counted(
    dtype: str,
    stage: int,
    *,
    steps: int,
    accumulation: int = 1,
    overflow_at: int | None = None,
    overflow_rank: int | None = None,
    fused_kernels: bool | None = False,
    extra_read: bool = False,
) -> tuple[list[StepReads], list[Read]]:
    """Train a :class:`TinyNet` engine for `steps` optimizer steps (on every rank of the
    default process group, if one is initialised), counting the host reads of each step's
    backward and step calls (not the forward: the model's own); the loss of step
    `overflow_at` is made infinite (on `overflow_rank` only, if given: fp16 then skips the
    step on every rank). `extra_read`: read
    ``engine.global_grad_norm`` inside the counted window too (a read put back on purpose).
    Returns the reads per step, and torch's own reads that are not of its optimizer's step
    counters (expected: none)."""
    torch.manual_seed(0)
    config = engine_config(dtype, stage, accumulation)
    engine = qwz.initialize(TinyNet(), config=config, fused_kernels=fused_kernels)
    working = next(engine.module.parameters()).dtype
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(1 + rank)
    counter = HostReads()
    per_step: list[StepReads] = []
    foreign: list[Read] = []
    with counter:
        for step in range(1, steps + 1):
            reads: list[Read] = []
            stepped = False
            for _ in range(accumulation):
                counter.counting = False
                inputs = torch.randn(4, 8, generator=generator).to(working)
                loss = engine(inputs).float().square().mean()
                if step == overflow_at and overflow_rank in (None, rank):
                    loss = loss * torch.inf
                counter.reads.clear()
                counter.counting = True
                engine.backward(loss)
                stepped = engine.step()
                if extra_read:
                    engine.global_grad_norm  # noqa: B018 -- the read under test
                reads += counter.reads
            counter.counting = False
            counters = {id(state["step"]) for state in engine.optimizer.optimizer.state.values()}
            foreign += [r for r in reads if r.origin == "torch" and r.tensor_id not in counters]
            qwz_reads = [(read.where, read.what) for read in reads if read.origin == "qwz"]
            per_step.append(StepReads(stepped, qwz_reads))
    return per_step, foreign
