"""The implementations a qualification can drive, behind one small interface.

``qwz``: qwz's own engine (``qwz.initialize``). ``deepspeed``: DeepSpeed's
ZeRO-1/2 engine, stock for the reference arm and with qwz's gather for the
candidate arms (``qwz.integrations.deepspeed.initialize``). ``deepspeed-native``:
DeepSpeed's own ZeRO-1/2 for every arm, built by a plain ``deepspeed.initialize``
with the arm's config untouched -- nothing of qwz inside the engine; the harness
reads its optimizer through the seam's functions
(``qwz.integrations.deepspeed.shards.own_shards``) without attaching anything.
Every subject is read through the same seam, [Note: own shards] (qwz/shards.py):
``own_shards()`` and ``shard_optimizer``. The harness uses that seam, the model's
parameters and the values below, never an engine's internals.

[Note: subject identity]
A DeepSpeed subject is the ``deepspeed`` package the ranks import: the installed one, an
editable install (``pip install -e PATH``), or the source checkout given as
``--deepspeed-src PATH``, which :func:`use_deepspeed_source` puts first on ``sys.path``
and ``PYTHONPATH`` of every rank and of the preflight (local ranks, forked or spawned, and
torchrun's alike)
and then verifies: ``deepspeed.__file__`` must lie under PATH, or the rank refuses to run.
Its identity (qualify/evidence/provenance.py ``subject()``) is read from what was imported: the
package's directory, the live ``git rev-parse HEAD``, dirty flag and diff digest of the
checkout it lies in, its version, and an installed distribution's ``direct_url.json``;
the commit DeepSpeed wrote into ``git_version_info`` at install time is context only.

[Note: reported group size]
Where DeepSpeed says which group size it uses, the probe shows it beside the wire's
(qualify/evidence/rules/group_size_on_wire.py). Read in this order, the first that exists wins: the
engine's config accessor ``engine.zero_quantized_weights_group_size()`` (DeepSpeed's style for every
ZeRO key, as ``engine.zero_quantized_weights()``), the ZeRO config model's field
``engine._config.zero_config.zero_quantized_weights_group_size``, then the optimizer's
``quantization_group_size`` attribute. DeepSpeed 0.19 has none of them (it reports no
group size); a reported value is only shown and compared, the wire's bytes decide.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist

import qwz
from qwz.qualify.base.plan import DEEPSPEED_SUBJECTS, SUBJECTS
from qwz.qualify.run import child
from qwz.shards import OwnShard


class ArmEngine:
    """One trained configuration: ``train_step(loss)``, ``module``, ``grad_norm``,
    ``group_size`` (what the engine reports), and the seam: ``own_shards()`` and
    ``shard_optimizer``."""

    module: torch.nn.Module
    grad_norm: float | None
    group_size: int | None
    optimizer: Any

    def train_step(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    reported_by: str | None = None
    """Where ``group_size`` was read ([Note: reported group size]); None: not reported."""

    def own_shards(self) -> list[OwnShard]:
        return self.optimizer.own_shards()

    @property
    def shard_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.shard_optimizer

    def shard_group_ranks(self) -> list[tuple[int, ...]]:
        """Per own shard, the global ranks of the process group its weights are gathered
        over (qwz's engine: its one process group, by default the whole world)."""
        if not dist.is_initialized():
            return [(0,) for _ in self.own_shards()]
        group = getattr(self.optimizer, "process_group", None) or dist.group.WORLD
        return [tuple(dist.get_process_group_ranks(group)) for _ in self.own_shards()]


class QwzArm(ArmEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        fused_kernels: bool | None,
        shard_alignment: int | None = None,
    ):
        self.engine = qwz.initialize(
            model, config=config, fused_kernels=fused_kernels, shard_alignment=shard_alignment
        )
        self.module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.group_size = self.optimizer.quantization_group_size
        self.reported_by = "optimizer.quantization_group_size"

    @property
    def grad_norm(self) -> float | None:  # read when asked: the timed steps never ask
        return self.engine.global_grad_norm

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()


class DeepSpeedArm(ArmEngine):
    """DeepSpeed's engine; `qwz_gather` selects qwz's gather (candidates) or stock (reference)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        qwz_gather: bool,
        fused_kernels: bool | None,
        model_parameters: list[Any] | None = None,
    ):
        from qwz.integrations import deepspeed as integration

        self.engine, *_ = integration.initialize(
            model=model,
            model_parameters=_parameters(model, model_parameters),
            config=config,
            qwz_gather=qwz_gather,
            fused_kernels=fused_kernels,
        )
        self.module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.group_size = getattr(self.optimizer, "quantization_group_size", None)
        self.reported_by = None if self.group_size is None else "optimizer.quantization_group_size"
        self.grad_norm = None

    def train_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.grad_norm = float(norm) if norm is not None else float("nan")

    def shard_group_ranks(self) -> list[tuple[int, ...]]:
        if not dist.is_initialized():
            return [(0,) for _ in self.optimizer.real_dp_process_group]
        return [
            tuple(dist.get_process_group_ranks(group))
            for group in self.optimizer.real_dp_process_group
        ]


class NativeDeepSpeedArm(DeepSpeedArm):
    """DeepSpeed's own engine from a plain ``deepspeed.initialize``: the config as given
    (``zero_quantized_weights`` and its group size included), nothing replaced or attached."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        model_parameters: list[Any] | None = None,
    ):
        import deepspeed

        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=_parameters(model, model_parameters),
            config=config,
        )
        self.module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.group_size, self.reported_by = reported_group_size(self.engine)
        self.grad_norm = None

    def own_shards(self) -> list[OwnShard]:
        from qwz.integrations.deepspeed.shards import own_shards

        return own_shards(self.optimizer)

    @property
    def shard_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer


def _parameters(model: torch.nn.Module, model_parameters: list[Any] | None) -> list[Any]:
    """DeepSpeed's ``model_parameters``: as given (param groups: the experts apart for MoE),
    else every trainable parameter."""
    if model_parameters is not None:
        return model_parameters
    return [p for p in model.parameters() if p.requires_grad]


def reported_group_size(engine: Any) -> tuple[int | None, str | None]:
    """The group size DeepSpeed reports and where it was read ([Note: reported group
    size]); (None, None) where it reports none."""
    accessor = getattr(engine, "zero_quantized_weights_group_size", None)
    if callable(accessor):
        return _size(accessor()), "engine.zero_quantized_weights_group_size()"
    zero_config = getattr(getattr(engine, "_config", None), "zero_config", None)
    if hasattr(zero_config, "zero_quantized_weights_group_size"):
        value = zero_config.zero_quantized_weights_group_size
        return _size(value), "engine._config.zero_config.zero_quantized_weights_group_size"
    if hasattr(engine.optimizer, "quantization_group_size"):
        return _size(engine.optimizer.quantization_group_size), "optimizer.quantization_group_size"
    return None, None


def _size(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def make_arm(
    subject: str,
    model: torch.nn.Module,
    config: dict[str, Any],
    *,
    quantized: bool,
    fused_kernels: bool | None = False,
    qwz_gather: bool = True,
    shard_alignment: int | None = None,
    model_parameters: list[Any] | None = None,
) -> ArmEngine:
    """`fused_kernels`: as ``qwz.initialize``'s (None: fused where they work on every rank,
    else eager, the reason in the engine's ``kernel_fallback``).
    `shard_alignment`: qwz only ([Note: padding rule], qwz/layout.py); DeepSpeed
    partitions its own buffers and refuses the argument. `model_parameters`: DeepSpeed's
    (param groups, as the MoE workload needs); qwz's engine takes the model's parameters."""
    if subject == "qwz":
        return QwzArm(model, config, fused_kernels, shard_alignment)
    if shard_alignment is not None:
        raise ValueError(
            f"shard_alignment: {shard_alignment} is invalid for subject {subject!r}: only "
            "qwz's engine takes one (DeepSpeed partitions its own buffers)"
        )
    if subject == "deepspeed":
        return DeepSpeedArm(
            model,
            config,
            qwz_gather=quantized and qwz_gather,
            fused_kernels=fused_kernels,
            model_parameters=model_parameters,
        )
    if subject == "deepspeed-native":
        return NativeDeepSpeedArm(model, config, model_parameters)
    raise ValueError(f"subject: {subject!r} is unknown; choose one of {', '.join(SUBJECTS)}")


# ------------------------------------------------------------ the DeepSpeed source


class DeepSpeedSourceError(RuntimeError):
    """The ``deepspeed`` a rank imported is not the one ``--deepspeed-src`` names."""


def _under(path: pathlib.Path, root: pathlib.Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def extensions_dir(root: pathlib.Path) -> pathlib.Path:
    """Where the DeepSpeed at `root` JIT-builds its ops ([Note: ops of a checkout]).

    [Note: ops of a checkout]
    DeepSpeed builds its C++ ops on first use (on CPU the shared-memory comm op, at
    ``deepspeed.init_distributed``) into ``$TORCH_EXTENSIONS_DIR/<op name>``; the build
    command names the source's absolute path, so two DeepSpeed sources (the installed one,
    a base checkout, a pull request's) sharing one directory rebuild each other's op on
    every run, and a build killed half-way leaves a lock every later run waits on. Unless
    the user set ``TORCH_EXTENSIONS_DIR``, ``--deepspeed-src PATH`` builds into a directory
    of its own, keyed by PATH."""
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return cache / "qwz" / "torch_extensions" / key


def use_deepspeed_source(source: str | None) -> None:
    """[Note: subject identity]: import ``deepspeed`` from the checkout at `source` (None:
    wherever it is installed) in this process and, through ``PYTHONPATH``, in every process
    it starts; raise :class:`DeepSpeedSourceError` unless ``deepspeed.__file__`` lies under
    `source`."""
    if source is None:
        return
    root = pathlib.Path(source).resolve()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(root)))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, paths)])
    import deepspeed

    imported = pathlib.Path(deepspeed.__file__)
    if not _under(imported, root):
        rank = os.environ.get("RANK", "0")
        raise DeepSpeedSourceError(
            f"--deepspeed-src {source}: rank {rank} imported deepspeed from {imported.parent}, "
            f"not from under {root} (deepspeed was imported before the path was set, or "
            f"{root} holds no deepspeed/ package)"
        )


def rank_imports(subject: str) -> tuple[str, ...]:
    """The modules a rank of `subject` imports before its first step, for a launcher that
    imports them once for all its ranks ([Note: forked ranks], run/launch.py):
    ``torch._dynamo``, which ``torch.optim`` and the deterministic settings pull in, and for a
    DeepSpeed subject ``deepspeed``, from where :func:`use_deepspeed_source` found it, and
    ``torch._inductor.compile_fx`` (about 600 modules), which ``deepspeed.initialize`` pulls
    in when its optimizer check imports a module that applies ``torch.compile()``."""
    if subject in DEEPSPEED_SUBJECTS:
        return ("torch._dynamo", "torch._inductor.compile_fx", "deepspeed")
    return ("torch._dynamo",)


PREFLIGHT = """
import json, sys
request = json.load(sys.stdin)
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
refusals = []
for arm, config in request["configs"].items():
    try:
        DeepSpeedConfig(config)
    except Exception as error:
        refusals.append([arm, f"{type(error).__name__}: {error}"])
report = {"file": deepspeed.__file__, "version": deepspeed.__version__, "refusals": refusals}
print("QWZ-PREFLIGHT " + json.dumps(report))
"""


def deepspeed_native_problems(
    source: str | None,
    configs: dict[str, dict[str, Any]],
    subject: str = "deepspeed-native",
    timeout_s: float = 600.0,
) -> list[str]:
    """Why a DeepSpeed `subject` cannot run, one line each, found before any rank starts: in
    a subprocess with the ranks' ``PYTHONPATH``, import deepspeed (from under `source` when
    given) and have DeepSpeed's own config parse every arm's config (``deepspeed-native``;
    ``deepspeed`` with ``--ds-config``). A refusal names DeepSpeed's message and the version
    and commit that refused."""
    environment = dict(os.environ)
    if source is not None:
        root = pathlib.Path(source)
        if not (root / "deepspeed" / "__init__.py").is_file():
            return [f"--deepspeed-src {source}: no deepspeed/__init__.py there (not a checkout)"]
        paths = [str(root.resolve()), *filter(None, environment.get("PYTHONPATH", "").split(":"))]
        environment["PYTHONPATH"] = os.pathsep.join(paths)
    report = _ask_deepspeed(
        PREFLIGHT, "QWZ-PREFLIGHT ", environment, timeout_s, json.dumps({"configs": configs})
    )
    if isinstance(report, str):
        return [f"--subject {subject}: {report}"]
    package = pathlib.Path(report["file"]).resolve().parent
    if source is not None and not _under(package, pathlib.Path(source)):
        return [f"--deepspeed-src {source}: deepspeed was imported from {package}, not from it"]
    if not report["refusals"]:
        return []
    version = _version_text(package, report["version"])
    return [
        f"--subject {subject}: {version} refuses the config of arm {arm!r}: "
        + " ".join(message.split())
        for arm, message in report["refusals"]
    ]


FP16_PROBE = """
import json
import deepspeed
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
report = {"device": accelerator.device_name(), "fp16": bool(accelerator.is_fp16_supported())}
print("QWZ-FP16 " + json.dumps(report))
"""


def deepspeed_fp16_problems(
    source: str | None, backend: str, timeout_s: float = 600.0
) -> list[str]:
    """Why a DeepSpeed subject cannot train fp16 here, found before any rank starts:
    DeepSpeed's engine refuses fp16 ("Type fp16 is not supported on your device") exactly
    when its accelerator's ``is_fp16_supported()`` is falsy; its CPU accelerator asks
    oneDNN, which has fp16 only on CPUs with AVX512-FP16 or AMX-FP16. Asked in a subprocess
    with the ranks' import path and, for a gloo `backend`, the CPU accelerator the ranks
    get (qwz.devices.use_cpu_accelerator_for_gloo)."""
    from qwz import devices

    environment = dict(os.environ)
    if source is not None:
        paths = [str(pathlib.Path(source).resolve()), environment.get("PYTHONPATH", "")]
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    if not devices.uses_cuda(backend):
        environment[devices.DEEPSPEED_ACCELERATOR_ENV] = "cpu"
    report = _ask_deepspeed(FP16_PROBE, "QWZ-FP16 ", environment, timeout_s)
    if isinstance(report, str):
        return [f"--dtype fp16: {report}"]
    if report["fp16"]:
        return []
    return [
        f"--dtype fp16: DeepSpeed refuses fp16 on this machine: its {report['device']} "
        "accelerator reports no fp16 (is_fp16_supported() is falsy; on CPU oneDNN needs "
        "AVX512-FP16 or AMX-FP16), so no DeepSpeed arm can train; --subject qwz "
        "qualifies fp16 here"
    ]


def _ask_deepspeed(
    script: str,
    marker: str,
    environment: dict[str, str],
    timeout_s: float,
    stdin_text: str | None = None,
) -> dict[str, Any] | str:
    """Run `script` (which imports deepspeed) in a child (run/child.py) and return the JSON it
    printed after `marker`, or why there is none: the import took too long, or it failed (the
    last line of its stderr)."""
    answer = child.ask(
        script,
        marker=marker,
        environment=environment,
        timeout_s=timeout_s,
        stdin_text=stdin_text,
        fresh=("deepspeed",),  # the child imports it from its own path
    )
    if isinstance(answer, child.NoAnswer):
        if answer.kind == "timeout":
            return f"importing deepspeed took {answer.message}"
        return f"cannot import deepspeed: {answer.message}"
    return answer


def _version_text(package: pathlib.Path, version: str) -> str:
    """ "DeepSpeed 0.19.8 at <sha> (dirty) from <path>": who refused."""
    from qwz.qualify.evidence import provenance

    checkout = provenance.package_checkout(package)
    where = (
        f"at {checkout.sha[:12]}{' (dirty)' if checkout.dirty else ''}"
        if checkout
        else "(not a git checkout)"
    )
    return f"DeepSpeed {version} {where} from {package}"
