"""Before a run, the launcher asks whether the ranks' fused kernels can serve, and says so.

[Note: fused kernels checked before a run]
A run asks for the fused wire kernels by default. Each rank checks them itself before its
first gather (qwz.kernels.choose_kernels: the native build on CPU, a self-test of the
``torch.compile`` kernels on a GPU); where they fail, that rank's engine falls back to the
eager kernels (the same bytes), every rank follows it (collectives.agree_on_kernels), and
the record's ``kernels`` names the fallback and its reason on every rank. The launcher
checks first, so a run that will not use them says so before it trains:

- the CPU's native build, in this process (run_request.py): where the fused kernels cannot serve
  on the CPU, the run asks for the eager ones and its plan says so;
- with CUDA ranks, the self-test on the first GPU (:func:`cuda_failure`), in a child
  process: the launcher must hold no CUDA context, which would take memory on that GPU for
  the whole run. A failure is reported and the run goes on asking for the fused kernels:
  each rank's own GPU decides, and the record names what each rank ran.

Under torchrun every rank is its own launcher, and its engine checks its own GPU.
"""

from __future__ import annotations

import multiprocessing
import sys

import torch

from qwz.kernels import self_test
from qwz.optimizer import WORKING_DTYPES
from qwz.qualify.base.plan import RunPlan

CUDA_CHECK_TIMEOUT_S = 900.0
"""How long the child process may take (a cold compile of the kernels included)."""


def _self_test_child(connection, device: str, dtype: torch.dtype) -> None:
    try:
        connection.send(self_test(torch.device(device), dtype))
    except BaseException as error:  # any failure is the answer
        connection.send(f"{type(error).__name__}: {error}")


def self_test_in_child(
    device: str, dtype: torch.dtype, timeout_s: float = CUDA_CHECK_TIMEOUT_S
) -> str | None:
    """Why the fused kernels cannot serve gathers on `device` into `dtype`
    (qwz.kernels.self_test), asked in a child process; None when they can."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_self_test_child, args=(sender, device, dtype), daemon=True)
    child.start()
    sender.close()
    try:
        if receiver.poll(timeout_s):
            return receiver.recv()
        return f"the self-test on {device} did not answer within {timeout_s:g} s"
    except EOFError:
        return f"the self-test on {device} died (exit code {child.exitcode})"
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


def ranks_use_cuda(world_size: int) -> bool:
    """Whether a local launch of `world_size` ranks puts each on a GPU (launch.pick_backend)."""
    from qwz.qualify.run.launch import pick_backend

    return pick_backend(world_size) == "nccl"


def cuda_failure(plan: RunPlan, world_size: int, under_torchrun: bool) -> str | None:
    """[Note: fused kernels checked before a run]: with CUDA ranks launched here and the
    fused kernels asked for, why they fail their self-test on the first GPU (printed), or
    None."""
    if plan.kernels != "fused" or under_torchrun or not ranks_use_cuda(world_size):
        return None
    reason = self_test_in_child("cuda:0", WORKING_DTYPES[plan.dtype])
    if reason is not None:
        print(
            f"qwz-qualify: the fused kernels fail their self-test on cuda:0 ({reason}); each "
            "rank whose GPU fails it too runs the eager kernels, every rank with it, and the "
            "record names the fallback",
            file=sys.stderr,
        )
    return reason
