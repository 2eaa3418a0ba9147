"""What an arm's observers hear: the events of the arm's loop (run/arm_run.py's ``_ArmRun``), in
the order it meets them, and what each reports.

The loop trains one arm step by step and calls every observer of the arm at each event, in
the order of its list; an observer keeps what it sees and reports, when the arm ends, the
fields of the arm's ``ArmObservation`` it owns (qualify/evidence/observation.py): no two
report the same field. The step itself -- its loss, the failures every rank agrees on, the
update check's and the overflow watch's parts inside it -- is the loop's own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from qwz.integrations.probe import WireProbe
from qwz.qualify.run.observers.staging_memory import WindowMemory


class Window(NamedTuple):
    """A step's wire window, closed at the next use of its weights ([Note: the wire window],
    qualify/run/wire_window.py)."""

    probe: WireProbe | None
    """What it carried (None: no window was open)."""
    memory: WindowMemory | None
    """The gather's memory while the subject ran in it (None: not counted)."""
    gathered: bool
    """Whether its step ran the weight gather (not an fp16 overflow skip)."""


class ArmObserver:
    """One thing observed of an arm; every event is a no-op unless the observer says
    otherwise."""

    def after_step(self, step: int, first_update_step: int | None) -> None:
        """A step completed (outside its memory window); `first_update_step`: the first step
        any rank's optimizer took, so far (None: none yet)."""

    def window_closed(self, window: Window) -> None:
        """The last step's wire window closed: the weights are used next."""

    def at_next_use(self, step: int, first_update_step: int | None) -> None:
        """The weights after `step`, at their next use ([Note: observed at the next use],
        qualify/run/next_use.py)."""

    def end(self) -> None:
        """The arm trained to its last step, or to a failure every rank agreed on."""

    def report(self) -> dict[str, Any]:
        """The ``ArmObservation`` fields this observer owns."""
        return {}

    def close(self) -> None:
        """Release what it holds on the engine (hooks)."""
