"""The AdamW step re-derived on a sample of master elements, and the gradient norm it was
handed, through the public seam only ([Note: own shards], qwz/shards.py).

[Note: exact update check]
Given the gradient the optimizer is handed (this arm's own reduced and clipped
gradient) and its state before the step, an AdamW step is a fixed formula of
the run's hyperparameters (the plan's lr, betas, eps, weight decay -- not what
the optimizer object says, so a candidate that changed its own learning rate
is caught). ``UpdateCheck`` hooks the torch optimizer that steps the master
shards, captures a fixed, seeded sample of master elements, gradients and
moments before each step and the same elements after it, and recomputes the
step in float64::

    p1 = p0 * (1 - lr * wd)
    m1 = b1 * m0 + (1 - b1) * g          v1 = b2 * v0 + (1 - b2) * g**2
    p2 = p1 - lr / (1 - b1**t) * m1 / (sqrt(v1) / sqrt(1 - b2**t) + eps)

torch computes the same in float32. Each operation rounds once (relative
error <= 2**-24), so with ``u`` the update term and ``e`` = float32 epsilon::

    |p2_torch - p2| <= e * (|p1| + |p2|) + 16e * |u|
                       + 16e * lr / bc1 * (b1|m0| + (1-b1)|g|) / d + 2**-126

(the first term: the decay factor, the decayed weight and the final
subtraction, each rounded once; then the update's own roundings, and the
moments' roundings propagated through the division by ``d``, the float64
denominator). The moments get ``8e * (|old| + |new|)``.
Any error in the formula -- a learning rate off by any factor, a dropped weight
decay, a flipped or stale moment -- is far outside this, and the bound never
loosens with the step. Two more exact facts are checked on the same sample:
*continuity* (the master before step ``t`` equals, bit for bit, the master
after step ``t - 1``: nothing but the optimizer writes a master) and *one step
per step* (the optimizer stepped exactly once on every rank for every training
step; a silent skip is a failure).

[Note: float32 hyperparameters]
A fused Adam (DeepSpeed's FusedAdam on a GPU, its CPU Adam op on a CPU) takes the
hyperparameters as float32 arguments: beta2 = 0.999 becomes 0.99900001287, so its
``1 - beta2`` is 1.3e-5 (about 108 float32 ulps) away from 0.001, and it forms the bias
corrections ``1 - beta**t`` in float32 (a power rounded once, or a running product
rounded once per step). That is a correct AdamW -- of the float32 values of the
configured hyperparameters -- that the float64 formula above fails by an order of
magnitude in the second moment. So each sampled element is judged against two readings
of the same formula, and passes within the bound of either: the *exact* reading (the
hyperparameters as configured, torch's arithmetic) and the *float32* reading (lr, betas,
eps and weight decay rounded to float32 first, and the bound widened by
``|u| * (s1 + s2 / 2)``, ``s = ((t + 1) * 2**-24 * beta**t + 2**-24) / (1 - beta**t)``:
the error of a bias correction formed in float32 with up to t roundings). Both readings
are AdamW of the configured values to float32 precision: a learning rate off by 0.1%, a
dropped weight decay or a beta of 0.99 for 0.999 is outside both.

[Note: global norm check]
The update check takes the gradient the optimizer is handed as given, so an
engine that computes the global norm wrongly -- and clips with it -- would pass
it on every arm alike. The judge recomputes what was applied instead: in the
shard optimizer's pre-step hook each rank sums the squares of every gradient it
is handed (float64: a float32 square is exact there), the sums are all-reduced
after the step, and the root ``H`` is the norm of the gradient that stepped.
With the engine's reported (pre-clip) norm ``N`` and the run's clipping ``c``::

    H == N * min(1, c / (N + 1e-6))     (H == N without clipping)

within ``2**-16 * H`` (an engine may sum in float32 in any tree order, DeepSpeed
does, and the clip coefficient and the scaled gradient round a few times more).
A norm computed wrongly and used to clip (the 2.21-instead-of-2.97 of kernels
compiled under another CPU capability), a wrong coefficient, or a clip that did
not happen all break it; a violation fails ``update``, named "(global gradient
norm)". What it cannot see: a *reported* norm that is wrong while the applied
coefficient is right, when both lie above ``c`` (the handed gradient's norm is
``c`` either way, and no number of the training changes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qwz import shards as seam
from qwz.qualify.evidence.optimizer import AdamWSettings
from qwz.qualify.run.observers.arm_observer import ArmObserver
from qwz.qualify.run.observers.piecewise import FLOAT32_EPS, FLOAT32_TINY, all_reduce, piece_numel


@dataclass
class UpdateResult:
    """Totals of the update check on one rank for one arm."""

    checked: int = 0
    violations: int = 0
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None
    missing_steps: list[int] = field(default_factory=list)
    """Training steps at which the optimizer did not step exactly once."""
    norm_checked: int = 0
    """Steps whose global gradient norm was recomputed ([Note: global norm check])."""
    norm_violations: int = 0
    norm_max_ratio: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    """fp16: training steps at which this rank's optimizer did not step; whether each was a
    legitimate overflow skip is the evidence's to decide ([Note: overflow pattern])."""
    optimizer: str = ""
    """The optimizer's class, ``module.qualname``: what stepped the masters."""


class StepAgreement(NamedTuple):
    """What every rank learns about a step from one all-reduce (:meth:`UpdateCheck.check_norm`)."""

    ranks_stepped: int
    """Ranks whose optimizer stepped."""
    ranks_overflowed: int
    """Ranks whose loss-scaled local gradient held an Inf or NaN (:class:`OverflowWatch`)."""


class UpdateCheck(ArmObserver):
    """[Note: exact update check] on a fixed sample of this rank's master elements.

    This class is longer than 150 lines because the check is one stateful algorithm on the
    optimizer's step hooks: the sample, its values before each step, the step re-derived,
    the steps counted and the handed norm share its state."""

    def __init__(
        self,
        shards: Sequence[seam.OwnShard],
        optimizer: torch.optim.Optimizer,
        settings: AdamWSettings | None,
        *,
        samples_per_shard: int,
        seed: int,
        rank: int,
        skips_allowed: bool = False,
    ):
        self.settings = settings
        """None: the arm's optimizer is not re-derived ([Note: the optimizer the update check
        re-derives], qualify/evidence/optimizer.py); the steps are counted and the handed
        gradient's norm checked, nothing else."""
        self.rank = rank
        self.skips_allowed = skips_allowed
        """fp16: a step without an optimizer step is recorded (``skipped_steps``), not a
        violation here; the sampled masters must not have moved across it."""
        self.optimizer = optimizer
        self.shards = list(shards)
        self.samples: list[torch.Tensor] = []
        generator = torch.Generator().manual_seed(seed * 7_919 + rank)
        for shard in self.shards:
            covered = torch.cat(
                [torch.arange(slot.start, slot.end) for slot in shard.slots]
                or [torch.empty(0, dtype=torch.int64)]
            )
            pick = torch.randperm(covered.numel(), generator=generator)[:samples_per_shard]
            self.samples.append(covered[pick].sort().values.to(shard.master.device))
        kind = type(optimizer)
        self.result = UpdateResult(optimizer=f"{kind.__module__}.{kind.__qualname__}")
        self.step = 0
        self._stepped = [0] * len(self.shards)
        """Per shard, the optimizer steps that included it in this training step."""
        self._optimizer_steps = [0] * len(self.shards)
        """Per shard, the optimizer steps taken so far: Adam's step count must equal it."""
        self._values_at_start = self._sampled_masters()
        self._before: dict[int, dict[str, torch.Tensor]] = {}
        self._last_after: dict[int, torch.Tensor] = {}
        self._grad_squares: torch.Tensor | None = None
        """float64 sum of squares of this rank's handed gradients, each shard's when it
        stepped ([Note: one step per param group])."""
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def report(self) -> dict[str, Any]:
        """The ``update`` field of the arm's observation."""
        return {"update": dataclasses.asdict(self.result)}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def begin_step(self, step: int) -> None:
        self.step = step
        self._stepped = [0] * len(self.shards)
        self._grad_squares = None

    def _sampled_masters(self) -> list[torch.Tensor]:
        return [
            shard.master.detach().reshape(-1)[index].double().cpu()
            for shard, index in zip(self.shards, self.samples, strict=True)
        ]

    def end_step(self) -> None:
        if self.skips_allowed and not any(self._stepped):
            self.result.skipped_steps.append(self.step)
            if self.settings is not None:
                self._check_unchanged()
            return
        if any(count != 1 for count in self._stepped):
            self.result.missing_steps.append(self.step)
            self.result.violations += 1
            counts = sorted(set(self._stepped))
            what = f"the optimizer stepped {counts[0]} times"
            if len(counts) > 1:
                what = "the optimizer stepped the shards " + ", ".join(
                    f"{shard.name} {count} times"
                    for shard, count in zip(self.shards, self._stepped, strict=True)
                )
            self._violation(-1, 0, what, math.inf)

    def _stepping(self, optimizer: Any) -> list[int]:
        """[Note: one step per param group]
        DeepSpeed's ZeRO-1/2 steps its torch optimizer once per param group, with
        ``param_groups`` narrowed to that group (two groups, so two calls, with MoE's experts
        apart); qwz's engine steps every shard in one call. So each call judges the shards
        whose masters are in the optimizer's param groups at that call, and each shard must
        be stepped exactly once per training step."""
        present = {id(param) for group in optimizer.param_groups for param in group["params"]}
        return [index for index, shard in enumerate(self.shards) if id(shard.master) in present]

    def _check_step_count(self, shard_index: int, counted: int, when: str, why: str) -> None:
        """Adam's step count of a shard equals the optimizer steps it was observed to take."""
        taken = self._optimizer_steps[shard_index]
        if counted != taken:
            self.result.violations += 1
            what = (
                f"Adam's step count of {self.shards[shard_index].name} is {counted} {when}, "
                f"but the optimizer stepped it {taken} times ({why})"
            )
            self._violation(-1, 0, what, math.inf)

    def _check_unchanged(self) -> None:
        """A step the optimizer did not take leaves every sampled master as it was, and
        Adam's step count too."""
        now_values = self._sampled_masters()
        for shard_index, now in enumerate(now_values):
            counted = self._step_count(self.shards[shard_index].master)
            self._check_step_count(
                shard_index, counted, "after a skipped step", "the skipped step was counted"
            )
            before = self._last_after.get(shard_index, self._values_at_start[shard_index])
            at = self._count(now != before)
            if at is not None:
                what = "master changed on a step the optimizer did not take"
                self._violation(shard_index, int(self.samples[shard_index][at]), what, math.inf)

    def _state(self, param: torch.Tensor, key: str, index: torch.Tensor) -> torch.Tensor:
        state = self.optimizer.state.get(param, {})
        value = state.get(key)
        if value is None:
            return torch.zeros(index.numel(), dtype=torch.float64)
        return value.detach().reshape(-1)[index].double().cpu()

    def _step_count(self, param: torch.Tensor) -> int:
        value = self.optimizer.state.get(param, {}).get("step", 0)
        return int(value.item() if isinstance(value, torch.Tensor) else value)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        active = self._stepping(optimizer)
        squares = _handed_squares([self.shards[index] for index in active])
        self._grad_squares = squares if self._grad_squares is None else self._grad_squares + squares
        self._before = {}
        for shard_index in active:
            self._stepped[shard_index] += 1
            if self.settings is None:
                continue
            shard, index = self.shards[shard_index], self.samples[shard_index]
            param = shard.master
            grad = param.grad
            counted = self._step_count(param)
            self._check_step_count(
                shard_index, counted, "before this step", "a step counted that was not taken"
            )
            values = param.detach().reshape(-1)[index].double().cpu()
            if shard_index in self._last_after:
                moved = values != self._last_after[shard_index]
                at = self._count(moved)
                if at is not None:
                    what = "master changed outside the optimizer step"
                    self._violation(shard_index, int(index[at]), what, math.inf)
            self._before[shard_index] = {
                "p": values,
                "g": (
                    torch.zeros_like(values)
                    if grad is None
                    else grad.detach().reshape(-1)[index].double().cpu()
                ),
                "m": self._state(param, "exp_avg", index),
                "v": self._state(param, "exp_avg_sq", index),
                "t": torch.tensor(counted + 1),
            }

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for shard_index, before in self._before.items():
            index = self.samples[shard_index]
            param = self.shards[shard_index].master
            actual = param.detach().reshape(-1)[index].double().cpu()
            self._last_after[shard_index] = actual
            self._optimizer_steps[shard_index] += 1
            moments = (
                self._state(param, "exp_avg", index),
                self._state(param, "exp_avg_sq", index),
            )
            # [Note: float32 hyperparameters]: each element within either reading's bound.
            readings = [
                _judged(_adamw(self.settings, before, float32), actual, moments)
                for float32 in READINGS
            ]
            pick = torch.stack([item.ratio for item in readings]).argmin(dim=0, keepdim=True)
            ratio, expected, bound = (
                torch.stack([getattr(item, key) for item in readings]).gather(0, pick)[0]
                for key in ("ratio", "expected", "bound")
            )
            self.result.checked += int(index.numel())
            if ratio.numel():
                worst = float(ratio.max())
                self.result.max_ratio = max(self.result.max_ratio, worst)
                at = self._count(ratio > 1)
                if at is not None:
                    what = (
                        f"expected {float(expected[at]):.9g}, got {float(actual[at]):.9g} "
                        f"(bound {float(bound[at]):.3g})"
                    )
                    self._violation(shard_index, int(index[at]), what, float(ratio[at]))
        self._before = {}

    @torch.no_grad()
    def check_norm(
        self,
        reported_norm: float,
        gradient_clipping: float,
        local_overflow: torch.Tensor | None = None,
    ) -> StepAgreement:
        """[Note: global norm check] for the step just taken; collective: every rank calls it
        after every step on which no rank failed. The same all-reduce counts the ranks that
        stepped and those whose `local_overflow` (:class:`OverflowWatch`) is set."""
        device = self.shards[0].master.device if self.shards else torch.device("cpu")
        squares = self._grad_squares
        local = torch.zeros(3, dtype=torch.float64, device=device)
        if squares is not None:
            local[0] = squares
            local[1] = 1.0  # this rank's optimizer stepped
        if local_overflow is not None:
            local[2] = local_overflow.to(device, torch.float64)
        handed_squares, ranks_stepped, ranks_overflowed = all_reduce(local).tolist()
        agreement = StepAgreement(int(ranks_stepped), int(ranks_overflowed))
        self._grad_squares = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if int(ranks_stepped) != world or not math.isfinite(reported_norm):
            # A missing step is a violation already (or, in fp16, the evidence's to judge); a
            # non-finite norm ends the arm or belongs to an overflow-skipped step.
            return agreement
        handed = math.sqrt(handed_squares)
        expected, bound = expected_handed_norm(reported_norm, gradient_clipping)
        ratio = abs(handed - expected) / bound
        result = self.result
        result.norm_checked += 1
        result.norm_max_ratio = max(result.norm_max_ratio, ratio)
        if ratio > 1:
            result.norm_violations += 1
            what = (
                f"the optimizer was handed a gradient of global norm {handed:.9g}; the engine "
                f"reports a norm of {reported_norm:.9g}, so with clipping at "
                f"{gradient_clipping:g} it must be {expected:.9g} (bound {bound:.3g})"
            )
            self._violation(-1, 0, what, ratio, parameter="(global gradient norm)")
        return agreement

    def _count(self, bad: torch.Tensor) -> int | None:
        """Add the sampled elements flagged in `bad` to the violations; the first one's
        sample position (None when none is flagged)."""
        if not bool(bad.any()):
            return None
        self.result.violations += int(bad.sum())
        return int(bad.nonzero()[0])

    def _violation(
        self, shard_index: int, position: int, what: str, ratio: float, parameter: str = ""
    ) -> None:
        if self.result.first_violation is not None:
            return
        name, index = (parameter or "(optimizer)", -1)
        if shard_index >= 0:
            name, index = seam.slot_of(self.shards[shard_index], position)
        self.result.first_violation = {
            "step": self.step,
            "rank": self.rank,
            "parameter": name,
            "index": index,
            "what": what,
            "ratio": ratio if math.isfinite(ratio) else None,
        }


NORM_RELATIVE_SLACK = 2.0**-16
"""[Note: global norm check]: how far, relative to it, the norm of the handed gradient may
lie from ``min(norm, clip)``."""


def expected_handed_norm(reported_norm: float, gradient_clipping: float) -> tuple[float, float]:
    """(the global norm the clipped gradient must have, the bound on its distance) given the
    engine's reported norm and the run's clipping threshold ([Note: global norm check])."""
    coefficient = 1.0
    if gradient_clipping > 0:
        coefficient = min(1.0, gradient_clipping / (reported_norm + 1e-6))
    expected = reported_norm * coefficient
    return expected, NORM_RELATIVE_SLACK * expected + FLOAT32_TINY


def _handed_squares(shards: Sequence[seam.OwnShard]) -> torch.Tensor:
    """float64 sum of squares of the gradients the optimizer is handed for `shards` (this
    rank's part of the global norm), in bounded pieces, without a host synchronisation."""
    device = shards[0].master.device if shards else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for shard in shards:
        grad = shard.master.grad
        if grad is None:
            continue
        flat = grad.detach().reshape(-1)
        piece = piece_numel(flat.device)
        for start in range(0, flat.numel(), piece):
            widened = flat[start : start + piece].double()  # fp32 squares are exact in fp64
            total += torch.dot(widened, widened)
    return total


class AdamWStep(NamedTuple):
    """One reading of the AdamW step on the sampled elements ([Note: exact update check])."""

    expected: torch.Tensor
    """The master after the step, float64."""
    bound: torch.Tensor
    """How far the master may lie from `expected`."""
    exp_avg: torch.Tensor
    exp_avg_bound: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_sq_bound: torch.Tensor


class Judged(NamedTuple):
    ratio: torch.Tensor
    """Per element, the worst of master, first and second moment, each against its bound."""
    expected: torch.Tensor
    bound: torch.Tensor


FLOAT32_UNIT_ROUNDOFF = FLOAT32_EPS / 2
READINGS = (False, True)
"""The readings an element may pass under: exact, float32 ([Note: float32 hyperparameters])."""


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _adamw(settings: AdamWSettings, before: dict[str, torch.Tensor], float32: bool) -> AdamWStep:
    """[Note: exact update check] of one step from the sampled state `before`, in the exact
    or the float32 reading ([Note: float32 hyperparameters])."""
    hyper = [settings.lr, *settings.betas, settings.eps, settings.weight_decay]
    lr, beta1, beta2, eps, wd = map(_float32, hyper) if float32 else hyper
    p0, g, m0, v0 = before["p"], before["g"], before["m"], before["v"]
    t = int(before["t"])
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    p1 = p0 * (1 - lr * wd)
    m1 = beta1 * m0 + (1 - beta1) * g
    v1 = beta2 * v0 + (1 - beta2) * g * g
    denom = v1.sqrt() / math.sqrt(bc2) + eps
    update = lr / bc1 * m1 / denom
    expected = p1 - update
    moment_terms = lr / bc1 * (beta1 * m0.abs() + (1 - beta1) * g.abs()) / denom
    bound = (
        FLOAT32_EPS * (p1.abs() + expected.abs())
        + 16 * FLOAT32_EPS * (update.abs() + moment_terms)
        + FLOAT32_TINY
    )
    if float32:
        unit = FLOAT32_UNIT_ROUNDOFF
        slack1 = ((t + 1) * unit * beta1**t + unit) / bc1
        slack2 = ((t + 1) * unit * beta2**t + unit) / bc2
        bound = bound + update.abs() * (slack1 + slack2 / 2)
    m_bound = 8 * FLOAT32_EPS * (m0.abs() + m1.abs()) + 1e-45
    v_bound = 8 * FLOAT32_EPS * (v0.abs() + v1.abs()) + 1e-45
    return AdamWStep(expected, bound, m1, m_bound, v1, v_bound)


def _judged(
    step: AdamWStep, actual: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor]
) -> Judged:
    """Each sampled element's worst ratio to its bound under the reading `step`."""
    exp_avg, exp_avg_sq = moments
    ratios = [
        (actual - step.expected).abs() / step.bound,
        (exp_avg - step.exp_avg).abs() / step.exp_avg_bound,
        (exp_avg_sq - step.exp_avg_sq).abs() / step.exp_avg_sq_bound,
    ]
    return Judged(torch.stack(ratios).amax(dim=0), step.expected, step.bound)
