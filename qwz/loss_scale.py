"""LossScaler: fp16 loss scaling with DeepSpeed's rules and keys.

fp16 gradients underflow where bf16 ones would not, so the engine multiplies the loss by a
scale before backward and the optimizer divides it out of the reduced gradient. A
gradient that overflows (an Inf or NaN anywhere, on any rank) means the scale was too
large: the step is skipped on every rank together and the scale may shrink.

[Note: dynamic loss scale]
The rules are DeepSpeed's ZeRO-1/2 fp16 rules (``fp16`` section), so one config trains the
same way under both:

- The scale starts at ``2**initial_scale_power``; ``loss_scale > 0`` fixes it instead
  (overflowing steps are still skipped).
- An overflow spends one unit of hysteresis; when only one is left, the scale halves
  instead, never below ``min_loss_scale``. An overflow at ``min_loss_scale`` is an error:
  the gradients are not finite at any allowed scale.
- Each step without overflow counts towards stability; when the number of clean steps
  since the last overflow (or since the start) is a positive multiple of
  ``loss_scale_window`` and at least one more, the scale doubles and the hysteresis is
  refilled. With ``consecutive_hysteresis`` every clean step refills it.

The scaler holds plain Python numbers, so every rank that sees the same overflow flags
(they are reduced across ranks) holds the same scale, and its state goes into checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qwz.config import LossScaleConfig

SCALE_FACTOR = 2.0
"""The dynamic scale doubles and halves by this factor."""


@dataclass
class LossScaler:
    """The current loss scale and the counters that move it; see [Note: dynamic loss scale]."""

    scale: float
    dynamic: bool
    window: int
    min_scale: float
    hysteresis: int
    consecutive_hysteresis: bool
    hysteresis_left: int
    steps: int = 0
    """Optimizer steps decided so far (skipped or not)."""
    last_overflow: int = -1
    """Index (in `steps`) of the last overflowing step; -1 before any."""

    @classmethod
    def from_config(cls, config: LossScaleConfig) -> LossScaler:
        return cls(
            scale=float(2**config.initial_scale_power) if config.dynamic else config.static_scale,
            dynamic=config.dynamic,
            window=config.window,
            min_scale=float(config.min_scale),
            hysteresis=config.hysteresis,
            consecutive_hysteresis=config.consecutive_hysteresis,
            hysteresis_left=config.hysteresis,
        )

    @classmethod
    def unscaled(cls) -> LossScaler:
        """A scale of 1 that never moves (bf16 and fp32 training)."""
        return cls.from_config(LossScaleConfig(static_scale=1.0))

    @property
    def at_floor(self) -> bool:
        """True when an overflow now would have to lower a dynamic scale that is already at
        `min_scale`: the gradients are not finite at any allowed scale, an error."""
        return self.dynamic and self._halves_now() and self.scale == self.min_scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and move the scale."""
        if self.dynamic:
            if overflow:
                if self._halves_now():
                    if self.at_floor:
                        raise FloatingPointError(
                            f"the gradients overflowed at the minimum loss scale "
                            f"(fp16.min_loss_scale = {self.min_scale:g})"
                        )
                    self.scale = max(self.scale / SCALE_FACTOR, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow = self.steps
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                clean = self.steps - self.last_overflow - 1
                if clean > 0 and clean % self.window == 0:
                    self.hysteresis_left = self.hysteresis
                    self.scale *= SCALE_FACTOR
        self.steps += 1

    def _halves_now(self) -> bool:
        return self.hysteresis == 1 or self.hysteresis_left == 1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError unless a checkpoint's `state` fits this scaler: the same keys,
        and the same mode (a fixed scale does not resume as a dynamic one, or back)."""
        self._check_keys(state)
        if state["dynamic"] != self.dynamic:
            mode = {True: "dynamic", False: "fixed"}
            raise ValueError(
                f"the saved loss scale is {mode[state['dynamic']]}, this engine's is "
                f"{mode[self.dynamic]} (fp16.loss_scale differs)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_keys(state)
        for key, value in state.items():
            setattr(self, key, value)

    def _check_keys(self, state: Any) -> None:
        expected = set(asdict(self))
        if not isinstance(state, dict) or set(state) != expected:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"loss scaler state: keys {keys} differ from {sorted(expected)}")
