"""What the harness watches on every rank and every step, through the public seam only.

Everything here reads an engine through [Note: own shards] (qwz/shards.py) --
``own_shards()`` and ``shard_optimizer`` -- and the model's parameters, never
an engine's internals, so the same observers serve qwz's engine and the
DeepSpeed drop-in (stock DeepSpeed included, for the reference arm).

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

[Note: layout-independent digests]
Two arms may shard differently (the group size changes the padding), so the
harness compares masters and replicas by per-parameter digests that do not
depend on who owns which element: for element ``i`` of a parameter with value
bits ``b``, ``term = ((b xor (i * K1)) * K2) mod 2**32`` (K2 odd), summed over
the elements each rank owns and then over ranks (int64, no overflow below 2**31
elements per parameter). Two parameters that differ in exactly one element
always get different digests (the term is a bijection of ``b`` for fixed
``i``), and any other difference is missed with probability about 2**-32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from qwz import shards as seam
from qwz.tolerance import own_shard_decode_check

K1 = 0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF
K2 = 0x85EBCA6B
MASK32 = 0xFFFFFFFF
FLOAT32_EPS = torch.finfo(torch.float32).eps
FLOAT32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class AdamWSettings:
    """The hyperparameters the run was configured with (the plan's, per arm identical)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def _all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


DIGEST_CHUNK_NUMEL = 1 << 16
"""Elements per piece of :func:`_digest_sum` on CPU (its temporaries stay in cache)."""


def _digest_sum(values: torch.Tensor, first_index: int) -> torch.Tensor:
    """int64 sum of the terms of [Note: layout-independent digests] of flat `values`, whose
    first element is element `first_index` of its parameter.

    The term is computed modulo 2**32 in int32, whose products wrap modulo 2**32 as the
    definition's do; a term read as int32 is its unsigned value minus 2**32 when negative,
    so the unsigned sum is the int32 sum plus 2**32 per negative term."""
    bits = values.detach().float().contiguous().view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    # On CPU in cache-sized pieces; elsewhere in one (each piece costs kernel launches).
    piece = DIGEST_CHUNK_NUMEL if values.device.type == "cpu" else max(1, bits.numel())
    # (j * K1) mod 2**32 for j in a piece, by the same int32 wrap.
    offsets = torch.arange(min(bits.numel(), piece), dtype=torch.int32, device=values.device)
    offsets *= _as_int32(K1 & MASK32)
    for start in range(0, bits.numel(), piece):
        chunk = bits[start : start + piece]
        # ((first + start + j) * K1) mod 2**32 = (first + start) * K1 + j * K1, mod 2**32.
        base = _as_int32(((first_index + start) * K1) & MASK32)
        terms = (offsets[: chunk.numel()] + base) ^ chunk
        terms *= _as_int32(K2)
        total += terms.sum(dtype=torch.int64) + (terms < 0).sum() * (MASK32 + 1)
    return total


def _as_int32(value: int) -> int:
    """`value` in [0, 2**32) as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


@torch.no_grad()
def master_digests(shards: Sequence[seam.OwnShard], names: Sequence[str]) -> dict[str, str]:
    """Per parameter, the digest of its fp32 master over all ranks ([Note: layout-independent
    digests]); collective: every rank must call it."""
    position = {name: index for index, name in enumerate(names)}
    device = shards[0].master.device if shards else torch.device("cpu")
    sums = torch.zeros(len(names), dtype=torch.int64, device=device)
    for shard in shards:
        master = shard.master.detach().reshape(-1)
        for slot in shard.slots:
            sums[position[slot.name]] += _digest_sum(
                master[slot.start : slot.end], slot.param_offset
            )
    _all_reduce(sums)
    return {name: f"{int(value):016x}" for name, value in zip(names, sums.tolist(), strict=True)}


@torch.no_grad()
def replica_digests(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, int64 digest per parameter) of this rank's working copy (not collective)."""
    names, digests = [], []
    for name, param in module.named_parameters():
        names.append(name)
        digests.append(_digest_sum(param.detach().reshape(-1), 0))
    return names, torch.stack(digests)


@torch.no_grad()
def replica_divergence(module: torch.nn.Module) -> list[str]:
    """Names of the parameters whose working copies differ between ranks (collective)."""
    names, digests = replica_digests(module)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []
    low, high = digests.clone(), digests.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return [name for name, differs in zip(names, (low != high).tolist(), strict=True) if differs]


def exact_masks(
    shards: Sequence[seam.OwnShard],
    group_size: int | None,
    param_numel: dict[str, int],
    preserve: int,
) -> list[torch.Tensor]:
    """Per shard, (n,) bool: the elements that must travel exactly whatever the engine says
    -- those of parameters of at most `preserve` elements (DESIGN: small parameters are sent
    exactly), and every element when nothing is quantized (`group_size` None)."""
    masks = []
    for shard in shards:
        mask = torch.zeros(shard.master.numel(), dtype=torch.bool, device=shard.master.device)
        for slot in shard.slots:
            if group_size is None or param_numel[slot.name] <= preserve:
                mask[slot.start : slot.end] = True
        masks.append(mask)
    return masks


@dataclass
class OwnShardResult:
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None


def check_own_shards(
    shards: Sequence[seam.OwnShard],
    exact: Sequence[torch.Tensor],
    group_size: int | None,
    step: int,
    rank: int,
    result: OwnShardResult,
) -> None:
    """The tight decode check of every own shard against its master (qwz/tolerance.py), with
    the *requested* group size and the design's exactness rule (`exact`, from
    :func:`exact_masks`), never the engine's claims."""
    for shard, mask in zip(shards, exact, strict=True):
        ratio, position = own_shard_decode_check(shard.master, shard.working, group_size or 1, mask)
        if math.isnan(ratio):  # a NaN decode is a violation, never a ratio max() ignores
            ratio = math.inf
        result.max_ratio = max(result.max_ratio, ratio)
        if ratio > 1.0 and result.first_violation is None:
            name, index = seam.slot_of(shard, position)
            result.first_violation = {
                "step": step,
                "rank": rank,
                "parameter": name,
                "index": index,
                "ratio": ratio if math.isfinite(ratio) else None,
                "exact_required": bool(mask[position]),
            }


@dataclass
class UpdateResult:
    """Totals of the update check on one rank for one arm."""

    checked: int = 0
    violations: int = 0
    max_ratio: float = 0.0
    first_violation: dict[str, Any] | None = None
    missing_steps: list[int] = field(default_factory=list)
    """Training steps at which the optimizer did not step exactly once."""


class UpdateCheck:
    """[Note: exact update check] on a fixed sample of this rank's master elements."""

    def __init__(
        self,
        shards: Sequence[seam.OwnShard],
        optimizer: torch.optim.Optimizer,
        settings: AdamWSettings,
        *,
        samples_per_shard: int,
        seed: int,
        rank: int,
    ):
        self.settings = settings
        self.rank = rank
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
        self.result = UpdateResult()
        self.step = 0
        self._calls = 0
        self._before: list[dict[str, torch.Tensor]] | None = None
        self._last_after: list[torch.Tensor] | None = None
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def begin_step(self, step: int) -> None:
        self.step = step
        self._calls = 0

    def end_step(self) -> None:
        if self._calls != 1:
            self.result.missing_steps.append(self.step)
            self.result.violations += 1
            self._violation(-1, 0, f"the optimizer stepped {self._calls} times", math.inf)

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
        self._calls += 1
        before = []
        for shard_index, (shard, index) in enumerate(zip(self.shards, self.samples, strict=True)):
            param = shard.master
            grad = param.grad
            values = param.detach().reshape(-1)[index].double().cpu()
            if self._last_after is not None:
                moved = values != self._last_after[shard_index]
                at = self._count(moved)
                if at is not None:
                    what = "master changed outside the optimizer step"
                    self._violation(shard_index, int(index[at]), what, math.inf)
            before.append(
                {
                    "p": values,
                    "g": (
                        torch.zeros_like(values)
                        if grad is None
                        else grad.detach().reshape(-1)[index].double().cpu()
                    ),
                    "m": self._state(param, "exp_avg", index),
                    "v": self._state(param, "exp_avg_sq", index),
                    "t": torch.tensor(self._step_count(param) + 1),
                }
            )
        self._before = before

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._before is None:
            return
        after = []
        lr, (beta1, beta2), eps, wd = (
            self.settings.lr,
            self.settings.betas,
            self.settings.eps,
            self.settings.weight_decay,
        )
        for shard_index, (shard, index, before) in enumerate(
            zip(self.shards, self.samples, self._before, strict=True)
        ):
            param = shard.master
            actual = param.detach().reshape(-1)[index].double().cpu()
            after.append(actual)
            m_new = self._state(param, "exp_avg", index)
            v_new = self._state(param, "exp_avg_sq", index)
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
            error = (actual - expected).abs()
            ratios = [error / bound]
            ratios.append((m_new - m1).abs() / (8 * FLOAT32_EPS * (m0.abs() + m1.abs()) + 1e-45))
            ratios.append((v_new - v1).abs() / (8 * FLOAT32_EPS * (v0.abs() + v1.abs()) + 1e-45))
            ratio = torch.stack(ratios).amax(dim=0)
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
        self._last_after = after
        self._before = None

    def _count(self, bad: torch.Tensor) -> int | None:
        """Add the sampled elements flagged in `bad` to the violations; the first one's
        sample position (None when none is flagged)."""
        if not bool(bad.any()):
            return None
        self.result.violations += int(bad.sum())
        return int(bad.nonzero()[0])

    def _violation(self, shard_index: int, position: int, what: str, ratio: float) -> None:
        if self.result.first_violation is not None:
            return
        name, index = ("(optimizer)", -1)
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


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or Inf on this rank."""
    return [
        name
        for name, param in module.named_parameters()
        if not bool(torch.isfinite(param.detach()).all())
    ]
