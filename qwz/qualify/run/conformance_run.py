"""The PR's config rules put to the subject's own parser and engine, before any training.

[Note: conformance run]
``qwz-qualify run`` hands every row of the judge's table (``ROWS``, [Note: the PR's config
rules] in qualify/evidence/rules/conformance.py) to the subject, and the record keeps what it did:

- **The subject's parser, then its engine.** Each config goes to the parser the candidate
  arms' configs go through; where it accepts a config of stage 1 or 2, an engine is built from
  it for a tiny model (``deepspeed.initialize`` or its equivalent), since the PR rejects fp32
  and ZenFlow "at optimizer initialization". Stage-3 rows are parsed only (the judge's note
  says why). An exception the subject raises is its refusal; the record keeps its type and
  text on one line (``MESSAGE_CHARS``).
- **Which parser is the subject's.** ``deepspeed-native``: DeepSpeed's own
  ``DeepSpeedConfig`` (what ``deepspeed.initialize`` parses with), then
  ``deepspeed.initialize``. ``deepspeed``: what its candidate arms run,
  ``qwz.integrations.deepspeed.initialize``, whose config checks (qwz's rules for its keys,
  the refusals where it takes over, those keys removed: ``takeover.prepare_config``) stand in
  front of DeepSpeed's own ``DeepSpeedConfig``; both must accept, as both must when the arm is
  built. ``qwz``: ``qwz.QwzConfig.from_deepspeed``, then ``qwz.initialize``.
- **In a process of its own, with the ranks' import path.** A subprocess gets this process's
  ``sys.path`` (which holds a ``--deepspeed-src`` checkout first, [Note: subject identity] in
  run/subjects.py, and is checked again there) and environment (the checkout's op directory,
  [Note: ops of a checkout]), so it parses with the code the ranks import, while its one-rank
  world, its engines and DeepSpeed's global state never touch the run's processes.
- **On the CPU, one rank, gloo.** The rules are a config's and an engine's construction, not a
  device's: DeepSpeed's CPU accelerator and a one-rank gloo world behave the same on any
  machine (a GPU machine builds DeepSpeed's CPU comm op once for it).
- **A harness failure is not a refusal.** A subprocess that cannot start, import what it
  needs, or report its table leaves the record's ``conformance.error`` set and the rows empty:
  the check is inconclusive, never the subject's FAIL ([Note: harness errors]).
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import socket
import sys
import tempfile
import time
from typing import Any

from qwz.qualify.run import child

MARKER = "QWZ-CONFORMANCE "
MESSAGE_CHARS = 300
"""The subject's message is kept to this many characters (pydantic's run long)."""
TIMEOUT_S = 900.0
"""The whole table, the first use of a DeepSpeed checkout's comm op build included (two to
five minutes on two loaded cores; the ranks would build it next otherwise)."""
ENGINE_STAGES = (1, 2)

PARSERS = {
    "deepspeed-native": "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed": "qwz.integrations.deepspeed's config checks (takeover.prepare_config), then "
    "deepspeed.runtime.config.DeepSpeedConfig",
    "qwz": "qwz.QwzConfig.from_deepspeed",
}
ENGINES = {
    "deepspeed-native": "deepspeed.initialize",
    "deepspeed": "qwz.integrations.deepspeed.initialize",
    "qwz": "qwz.initialize",
}

CHILD = (
    "import json, sys\n"
    "request = json.load(sys.stdin)\n"
    "sys.path[:] = request['sys_path']\n"
    "from qwz.qualify.run.conformance_run import serve\n"
    "serve(request)\n"
)


def run_table(
    subject: str,
    *,
    qwz_gather: bool = True,
    deepspeed_src: str | None = None,
    cpu_quantizer: bool = True,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """The record's ``conformance`` section: every row of the judge's table through the
    subject's parser and engine, in a subprocess ([Note: conformance run])."""
    from qwz.qualify.evidence.rules.conformance import ROWS

    request = {
        "subject": subject,
        "qwz_gather": qwz_gather,
        "deepspeed_src": deepspeed_src,
        "cpu_quantizer": cpu_quantizer,
        "rows": [{"row": row.name, "config": row.config} for row in ROWS],
        "sys_path": list(sys.path),
    }
    started = time.monotonic()
    answer = _ask(request, _child_environment(), timeout_s)
    if not isinstance(answer, str):
        answer = _checked(answer)
    return {
        "parser": PARSERS[subject],
        "engine": ENGINES[subject],
        "rows": [] if isinstance(answer, str) else answer,
        "seconds": round(time.monotonic() - started, 3),
        "error": answer if isinstance(answer, str) else None,
    }


def _checked(rows: Any) -> list[dict[str, Any]] | str:
    """The rows, or why they cannot go into a record: a harness bug must cost the table its
    verdict (inconclusive), never the run its record."""
    from pydantic import ValidationError

    from qwz.qualify.evidence.schema import ConformanceRow

    try:
        return [ConformanceRow.model_validate(row).model_dump(mode="json") for row in rows]
    except (ValidationError, TypeError) as error:
        return f"the table's rows do not match the record's schema: {str(error)[:500]}"


def _child_environment() -> dict[str, str]:
    """This process's environment as one rank of a one-rank world on the CPU."""
    from qwz.devices import DEEPSPEED_ACCELERATOR_ENV

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return dict(
        os.environ,
        **{DEEPSPEED_ACCELERATOR_ENV: "cpu", "CUDA_VISIBLE_DEVICES": ""},
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _ask(request: dict[str, Any], environment: dict[str, str], timeout_s: float):
    """The rows the subprocess observed, or why there are none (a harness error)."""
    source = request["deepspeed_src"]  # serve() puts it first, as the ranks do
    path = [str(pathlib.Path(source).resolve())] if source else []
    same = child.imported_from_path("deepspeed", [*path, *request["sys_path"]])
    answer = child.ask(
        CHILD,
        marker=MARKER,
        environment=environment,
        timeout_s=timeout_s,
        stdin_text=json.dumps(request),
        fresh=() if same else ("deepspeed",),
    )
    if isinstance(answer, child.NoAnswer):
        if answer.kind == "timeout":
            return f"the table took {answer.message}"
        if answer.kind == "start":
            return f"could not start the table's process: {answer.message}"
        return f"the table's process ended without its rows ({answer.message})"
    try:
        return answer["error"] if answer["error"] is not None else answer["rows"]
    except (KeyError, TypeError) as error:
        return f"the table's process reported no readable rows: {error!r}"[:500]


# ------------------------------------------------------------------ in the subprocess


def serve(request: dict[str, Any]) -> None:
    """The subprocess: observe every row and print them after ``MARKER``; a failure to set up
    (the DeepSpeed source, the one-rank world) is reported as the table's error."""
    subject = request["subject"]
    rows, error = [], None
    try:
        if subject != "qwz":
            from qwz.qualify.run import quantizer_op
            from qwz.qualify.run.subjects import use_deepspeed_source

            use_deepspeed_source(request["deepspeed_src"])
            quantizer_op.install(request.get("cpu_quantizer", True))
        with tempfile.TemporaryDirectory() as directory:
            _one_rank_world(directory)
            rows = [
                observe(subject, item["row"], item["config"], request["qwz_gather"])
                for item in request["rows"]
            ]
    except RunnerCannot as failure:  # the runner, not the subject: never a refusal
        error = str(failure)
    except Exception as failure:  # the harness's own setup: never a refusal
        error = f"setting up the table failed: {_message(failure)}"
    print(MARKER + json.dumps({"rows": rows, "error": error}), flush=True)


def _one_rank_world(directory: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _message(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


class RunnerCannot(RuntimeError):
    """A row the subject could not be asked on this runner: its quantizer op cannot load here
    and the harness's CPU implementation is off ([Note: a CUDA-only subject on a CPU runner],
    run/quantizer_op.py). The table's error, never the subject's refusal."""


def observe(subject: str, name: str, config: dict[str, Any], qwz_gather: bool) -> dict:
    """One row as the subject took it: its parser, then (stages 1 and 2) its engine. A row
    whose engine could not load the subject's op on this runner raises :class:`RunnerCannot`."""
    from qwz.qualify.run import quantizer_op

    refused_loads = quantizer_op.USAGE.refused
    ran = ["parse"]
    refused_at = message = group_size = None
    try:
        group_size = _PARSE[subject](copy.deepcopy(config), qwz_gather)
        zero = config.get("zero_optimization") or {}
        if zero.get("stage") in ENGINE_STAGES:
            ran.append("initialize")
            _INITIALIZE[subject](copy.deepcopy(config), qwz_gather)
    except Exception as error:  # the subject's refusal, by its parser or its engine
        if quantizer_op.USAGE.refused > refused_loads:
            raise RunnerCannot(
                f"row {name}: the subject's engine cannot be built on this runner: "
                f"{_message(error)}"
            ) from error
        refused_at, message = ran[-1], _message(error)
    return {
        "row": name,
        "config": config,
        "ran": ran,
        "observed": "accepted" if refused_at is None else "refused",
        "refused_at": refused_at,
        "message": None if refused_at is None else message,
        "group_size": group_size if refused_at is None else None,
    }


def _tiny_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _quantized_size(zero: Any) -> int | None:
    """The group size a parsed config resolved, where it asks for quantized weights."""
    if not getattr(zero, "zero_quantized_weights", False):
        return None
    size = getattr(zero, "zero_quantized_weights_group_size", None)
    return size if type(size) is int else None


def _parse_native(config: dict[str, Any], qwz_gather: bool) -> int | None:
    from deepspeed.runtime.config import DeepSpeedConfig

    return _quantized_size(DeepSpeedConfig(config).zero_config)


def _parse_drop_in(config: dict[str, Any], qwz_gather: bool) -> int | None:
    from deepspeed.runtime.config import DeepSpeedConfig

    from qwz.integrations.deepspeed.takeover import prepare_config

    prepared = prepare_config(config, qwz_gather)
    DeepSpeedConfig(prepared.config)
    return prepared.requested.group_size if prepared.requested.enabled else None


def _parse_qwz(config: dict[str, Any], qwz_gather: bool) -> int | None:
    import qwz

    parsed = qwz.QwzConfig.from_deepspeed(config)
    return parsed.group_size if parsed.quantized_weights else None


def _initialize_native(config: dict[str, Any], qwz_gather: bool) -> None:
    import deepspeed

    model = _tiny_model()
    deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)


def _initialize_drop_in(config: dict[str, Any], qwz_gather: bool) -> None:
    from qwz.integrations import deepspeed as drop_in

    model = _tiny_model()
    drop_in.initialize(
        model=model,
        model_parameters=list(model.parameters()),
        config=config,
        qwz_gather=qwz_gather,
        fused_kernels=False,
    )


def _initialize_qwz(config: dict[str, Any], qwz_gather: bool) -> None:
    import qwz

    qwz.initialize(_tiny_model(), config=config, fused_kernels=False)


_PARSE = {"deepspeed-native": _parse_native, "deepspeed": _parse_drop_in, "qwz": _parse_qwz}
_INITIALIZE = {
    "deepspeed-native": _initialize_native,
    "deepspeed": _initialize_drop_in,
    "qwz": _initialize_qwz,
}
