"""fp16: which ranks saw a non-finite loss or gradient, through hooks on the harness's own
tensors, never the engine's scaler ([Note: overflow observation] in runner.py)."""

from __future__ import annotations

import torch


class OverflowWatch:
    """[Note: overflow observation]
    fp16 only. What the evidence needs to judge a skipped step ([Note: overflow pattern],
    qualify/evidence/rules/overflow_pattern.py), observed through public torch hooks on the objects
    the harness owns -- never the engine's scaler or its overflow flag:

    - the loss scale actually applied: a hook on the loss tensor the harness computed and
      hands to ``train_step``; the gradient that reaches it is the factor the engine
      multiplied the loss by before backward (``d(s * loss)/d loss = s``, exact: a power
      of two in fp32), whatever the engine's scaler says;
    - whether this rank's loss-scaled gradient overflowed: a hook on every model
      parameter sees the gradient autograd computed for it (before any engine hook
      reduces or moves it) and ORs ``not isfinite(grad).all()`` into one device flag --
      no host synchronisation in backward.

    Each rank's gradient is divided by the world size before the fp16 reduction (qwz's
    engine always; DeepSpeed's ZeRO-1/2 with ``reduce_scatter``, its default, which the
    plan's configs keep), so the reduced gradient is finite exactly when every rank's was:
    the step must be skipped on every rank when any rank's flag is set, and taken
    otherwise."""

    def __init__(self, module: torch.nn.Module):
        params = [param for param in module.parameters() if param.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self._scale: torch.Tensor | None = None
        self._handles = [param.register_hook(self._see_gradient) for param in params]

    def _see_gradient(self, grad: torch.Tensor) -> None:
        finite = torch.isfinite(grad).all().to(self._nonfinite.device)
        torch.logical_or(self._nonfinite, ~finite, out=self._nonfinite)

    def _see_scale(self, grad: torch.Tensor) -> None:
        self._scale = grad.detach().float().reshape(()).clone()

    def watch(self, loss: torch.Tensor) -> None:
        """Observe the step whose loss is `loss` (call before ``train_step(loss)``)."""
        self._nonfinite.zero_()
        self._scale = None
        loss.register_hook(self._see_scale)

    @property
    def local_overflow(self) -> torch.Tensor:
        """0-dim bool on the parameters' device: this rank's scaled gradient was not finite."""
        return self._nonfinite

    def applied_scale(self) -> float | None:
        """The factor the loss was multiplied by before backward; None: no gradient reached
        the loss (the engine did not backpropagate through it)."""
        return None if self._scale is None else float(self._scale)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
