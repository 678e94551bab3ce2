"""What a rule returns: a verdict (the next settings, the action and its reason), or None to pass."""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.operator.controller.types import HOLD, Settings


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a rule decided: the next settings (chunk caps are fitted to the budget afterwards), the action
    and its reason, and what it means for the controller's memory."""

    settings: Settings
    action: str
    reason: str
    who: str = ""  # the one cluster acted on; "" = every cluster
    direction: int = 0  # +1 raised the budget, -1 cut it (State.last_direction)
    scale: bool = True  # a scale-out/in, shed or restore restarts the scale cooldown
    # A queue bound changes which arrivals are admitted, not how long an iteration takes: it is judged
    # after the scale cooldown, and the budget's own cooldown goes on counting.
    admission_only: bool = False
    cut_slo: float | None = None  # a cut: the strictest P99 TBT SLO it aimed at (State.cut_slo)


def hold(settings: Settings, reason: str) -> Verdict:
    """Keep `settings`, saying why."""
    return Verdict(settings, HOLD, reason)
