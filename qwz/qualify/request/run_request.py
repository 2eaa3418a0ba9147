"""``qwz-qualify run``'s request, resolved once: the parsed arguments in, one frozen
``RunRequest`` out, holding the plan the ranks run.

[Note: a request resolved once]
``resolve(args)`` is the one reader of ``run``'s parsed arguments. Every setting takes its
value once: given on the command line; else the ``--ds-config`` file's, for a setting that is
a key of the file ([Note: the user's DeepSpeed config], ds_config.py); else the preset's (its
GPU values where every rank gets a GPU, [Note: the long preset's workload] in
base/presets.py); else its declared default ([Note: one declaration per setting],
base/values.py). Then what the run derives from them: its world size (torchrun's under
torchrun; one rank per local GPU for a preset that asks and a command line that gives none,
[Note: the PR's evidence]), the workload's parameter count (on the meta device), the chunked
arm's bucket ([Note: the chunked arm], run/chunked_arm.py), one arm at a time where two do not
fit the GPUs ([Note: GPU memory estimate], gpu_memory.py) and the eager kernels where the
fused ones cannot serve this CPU ([Note: fused kernels checked before a run],
kernel_check.py). The plan is built from these, once. A request that cannot be resolved (an
optional package missing, a ``--ds-config`` refused) raises ``Refused``, one line per reason;
every other reason to refuse a run is ``preflight.problems(request)``'s, which reads the
request and changes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qwz.qualify.base import presets
from qwz.qualify.base.plan import Launch, RunPlan
from qwz.qualify.request import gpu_memory, settings

if TYPE_CHECKING:
    from qwz.qualify.run.workloads import Workload


class Refused(ValueError):
    """A request that cannot be resolved; ``problems`` says why, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class RunRequest:
    """One ``run`` request, resolved ([Note: a request resolved once])."""

    plan: RunPlan
    """What the ranks train and judge, every setting and derived size in it."""
    launch: Launch
    """How many ranks (as the settings say), how long, the ledger, the speed gate."""
    given: frozenset[str]
    """The settings given on the command line."""
    world_size: int
    """The ranks of this run: torchrun's world under torchrun, else ``launch.world_size``."""
    backend: str
    """The backend local ranks of this world use (the launcher's choice, run/launch.py)."""
    under_torchrun: bool
    out: pathlib.Path
    force: bool
    keep_previous: int | None
    allow_one_rank: bool
    deepspeed_src: pathlib.Path | None
    """``--deepspeed-src`` as given (the plan holds it resolved)."""
    argv: tuple[str, ...]
    """The command line, for the record's invocation ([Note: reproduce])."""
    refusals: tuple[str, ...]
    """Why the workload cannot run on this subject at this world size; where it cannot, the
    sizes below are not derived (they would build its model)."""
    numel: int | None
    """The workload's parameters."""
    memory: gpu_memory.MemoryFit | None
    """[Note: GPU memory estimate] on every GPU the ranks use."""
    one_arm_chosen: bool
    """Two arms do not fit and one does: the plan holds one at a time, the command line
    having said nothing."""
    eager_fallback: bool
    """The fused kernels were asked for and cannot serve here: the plan asks for eager."""

    def value(self, name: str) -> Any:
        """The resolved value of the run setting `name` (a plan's workload: the workload)."""
        return getattr(self.plan if settings.run_settings()[name].in_plan else self.launch, name)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size(world_size: int) -> int:
    """The ranks of a run whose settings say `world_size`: torchrun's world under torchrun."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else world_size


def _has_gpu_per_rank(world_size: int) -> bool:
    """Whether the ranks of this run each get a GPU: under torchrun, where this rank has
    one (the run then binds it, run/torchrun.py); else the launcher's own choice."""
    import torch

    from qwz.qualify.run.launch import pick_backend

    if under_torchrun():
        return torch.cuda.is_available()
    return pick_backend(world_size) == "nccl"


def _local_gpu_count() -> int:
    """CUDA devices this process sees (counted without creating a context on them)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings given on the command line (every flag's default is None, so a value
    that is not None was given), a repeated one as a tuple."""
    declared = settings.run_settings()
    given = {name: getattr(args, name, None) for name in declared}
    return {
        name: tuple(value) if declared[name].declaration.repeated else value
        for name, value in given.items()
        if value is not None
    }


def preset_values(args: argparse.Namespace) -> dict[str, Any]:
    """Every run setting's value before ``--ds-config``: given, else the preset's, else the
    declared default."""
    declared, given = settings.run_settings(), given_settings(args)
    preset = presets.PRESETS[given.get("preset") or presets.DEFAULT]
    unset = [name for name in preset.gpu_values if name not in given]
    world_size = launched_world_size(given.get("world_size") or declared["world_size"].default)
    from_preset = preset.values_for(bool(unset) and _has_gpu_per_rank(world_size))
    values = {}
    for name, setting in declared.items():
        value = given.get(name, from_preset.get(name, setting.default))
        values[name] = tuple(value) if setting.declaration.repeated else value
    if preset.every_local_gpu and "world_size" not in given and not under_torchrun():
        # [Note: the PR's evidence]: a rank per local GPU
        values["world_size"] = _local_gpu_count() or values["world_size"]
    return values


def resolve(args: argparse.Namespace) -> RunRequest:
    """[Note: a request resolved once]; ``Refused`` where it cannot be."""
    from qwz.qualify.request import ds_config, requirements
    from qwz.qualify.run.workloads import get_workload

    values = preset_values(args)
    wanted = requirements.needed(
        workload=values["workload"],
        subject=values["subject"],
        blocks=values["blocks"],
        learning_rule=values["learning_rule"],
    )
    missing = requirements.missing_packages(wanted)
    if missing:  # [Note: optional dependencies]: what follows may import them
        raise Refused(missing)
    world_size = launched_world_size(values["world_size"])
    given = given_settings(args)
    workload = get_workload(values["workload"], attention=values["attention"])
    values, refused = ds_config.apply(values, given, workload.params["micro_batch"], world_size)
    if refused:
        raise Refused(refused)
    return _derived(args, values, workload, frozenset(given), world_size)


def _derived(
    args: argparse.Namespace,
    values: Mapping[str, Any],
    workload: Workload,
    given: frozenset[str],
    world_size: int,
) -> RunRequest:
    """The request from its settings: the sizes they imply, and the plan."""
    from qwz.kernels import fused_available
    from qwz.qualify.run.chunked_arm import chunked_bucket
    from qwz.qualify.run.launch import pick_backend

    # What the run's layer knows of the workload, then what this layer makes of it.
    refusals = tuple(workload.refusals(values["subject"], world_size))
    numel = None if refusals else workload.numel(values["seed"])
    chunked = chunked_bucket(  # [Note: the chunked arm]
        workload,
        world_size=world_size,
        seed=values["seed"],
        group_sizes=values["group_sizes"],
        dtype=values["dtype"],
        allgather_bucket_size=values["allgather_bucket_size"],
    )
    backend = pick_backend(world_size)
    memory = None
    if numel is not None:
        memory = _memory_fit(values, given, workload, (world_size, backend), numel)
    one_arm_chosen = memory is not None and _chooses_one_arm(memory, values)
    eager_fallback = values["kernels"] == "fused" and not fused_available()
    source = args.deepspeed_src
    declared = settings.run_settings()
    plan_values = {name: values[name] for name, item in declared.items() if item.in_plan}
    plan_values.update(
        workload=workload,
        deepspeed_src=None if source is None else str(source.resolve()),
        chunked_allgather_bucket_size=chunked,
        one_arm_at_a_time=values["one_arm_at_a_time"] or one_arm_chosen,
        kernels="eager" if eager_fallback else values["kernels"],
    )
    launch_names = [field.name for field in dataclasses.fields(Launch)]
    return RunRequest(
        plan=RunPlan(**plan_values),
        launch=Launch(**{name: values[name] for name in launch_names}),
        given=given,
        world_size=world_size,
        backend=backend,
        under_torchrun=under_torchrun(),
        out=args.out,
        force=bool(getattr(args, "force", False)),
        keep_previous=getattr(args, "keep_previous", None),
        allow_one_rank=bool(getattr(args, "allow_one_rank", False)),
        deepspeed_src=source,
        argv=tuple(getattr(args, "argv", sys.argv[1:])),
        refusals=refusals,
        numel=numel,
        memory=memory,
        one_arm_chosen=one_arm_chosen,
        eager_fallback=eager_fallback,
    )


def _memory_fit(
    values: Mapping[str, Any],
    given: frozenset[str],
    workload: Workload,
    ranks: tuple[int, str],
    numel: int,
) -> gpu_memory.MemoryFit:
    """[Note: GPU memory estimate] on every GPU the ranks use; where two arms do not fit and
    one does, one arm at a time unless the command line said otherwise. `ranks`: the world
    size and the backend of local ranks."""
    params, (world_size, backend) = workload.params, ranks
    return gpu_memory.fit(
        world_size=world_size,
        numel=numel,
        dtype=values["dtype"],
        activations=gpu_memory.activation_bytes(params, values["dtype"]),
        one_arm_at_a_time=values["one_arm_at_a_time"],
        may_choose="one_arm_at_a_time" not in given and values["warmup_steps"] >= 1,
        indices=gpu_memory.indices_for_run(world_size, under_torchrun(), backend),
        eager_attention="model" in params and params.get("attention", "eager") == "eager",
    )


def _chooses_one_arm(memory: gpu_memory.MemoryFit, values: Mapping[str, Any]) -> bool:
    return memory.one_arm and not values["one_arm_at_a_time"] and not memory.problems
