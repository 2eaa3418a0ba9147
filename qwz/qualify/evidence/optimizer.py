"""The optimizer an arm's config asks for, as the update check re-derives it.

[Note: the optimizer the update check re-derives]
The update check ([Note: exact update check], qualify/run/observers/update.py) recomputes
AdamW, decoupled weight decay. It reads the hyperparameters from the arm's DeepSpeed config
(``arms[].config`` in the record: the same dict the engine was given), the way DeepSpeed
builds its optimizer from the ``optimizer`` section: ``"AdamW"``, or ``"Adam"`` unless
``adam_w_mode`` is false (then Adam with L2 weight decay, the same as AdamW only without
weight decay), case-insensitive, with the section's ``lr``, ``betas``, ``eps`` and
``weight_decay``. A hyperparameter the section leaves out is the default of the optimizer
DeepSpeed builds: with ``torch_adam`` true torch's class (``torch.optim.AdamW``: weight
decay 0.01; ``torch.optim.Adam``: 0), else DeepSpeed's own FusedAdam or CPU Adam (weight
decay 0); lr 1e-3, betas (0.9, 0.999) and eps 1e-8 in all of them. qwz's engine builds the
same optimizers from the same section (qwz/optimizer.py), so one reading serves every
subject; the harness states these defaults itself and never reads them from the code it
judges.

Any other optimizer (SGD, Lamb, Lion, Adagrad, ...) and Adam with L2 weight decay are not
re-derived: ``update`` is n/a and names the optimizer, never a FAIL of a formula the arm
never claimed to run. The global norm of the handed gradient ([Note: global norm check])
holds for any optimizer and is checked all the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
"""lr, betas and eps of torch's Adam and AdamW and of DeepSpeed's FusedAdam and CPU Adam."""
TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""``torch.optim.AdamW``'s default weight decay; every other Adam above defaults to 0."""
NO_CLIPPING = 0.0
"""DeepSpeed's ``gradient_clipping`` where a config leaves it out: no clipping."""


@dataclass(frozen=True)
class AdamWSettings:
    """The hyperparameters of an arm's AdamW, as its config gives them."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def adamw_of(config: Mapping[str, Any]) -> AdamWSettings | str:
    """The AdamW an arm's `config` builds ([Note: the optimizer the update check
    re-derives]), or why the update check cannot re-derive its optimizer."""
    section = config.get("optimizer")
    if not isinstance(section, Mapping):
        return "the config has no optimizer section"
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        return f"the optimizer is {section.get('type')!r}, not Adam or AdamW"
    params = section.get("params") or {}
    decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
    torch_adam = params.get("torch_adam", False) is True
    default_decay = TORCH_ADAMW_WEIGHT_DECAY if torch_adam and decoupled else 0.0
    try:
        betas = params.get("betas", ADAM_DEFAULTS["betas"])
        settings = AdamWSettings(
            lr=float(params.get("lr", ADAM_DEFAULTS["lr"])),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(params.get("eps", ADAM_DEFAULTS["eps"])),
            weight_decay=float(params.get("weight_decay", default_decay)),
        )
    except (TypeError, ValueError, IndexError, KeyError):
        return f"the optimizer's params {dict(params)!r} are not numbers"
    if not decoupled and settings.weight_decay != 0:
        return (
            f"the optimizer is Adam with L2 weight decay {settings.weight_decay:g} "
            "(adam_w_mode false), not AdamW"
        )
    return settings


def clipping_of(config: Mapping[str, Any]) -> float:
    """The global-norm clipping threshold of an arm's `config` (0: none)."""
    return float(config.get("gradient_clipping", NO_CLIPPING))
