"""The controller's cooldowns, declared once.

A cooldown holds one kind of change until enough control intervals have passed since the change it waits
out, so that change is judged on samples taken after it. Each is declared below: the `State` counter it
reads, the `ControllerConfig` field that sets its length, and what a hold in it says. The rules ask
`cooling(...)` and hold with `wait_out(...)`; they never compare counters themselves. The counters' life
is here too: `tick` counts them one interval forward (decide.next_interval), `restart` zeroes the ones a
change restarts (decide.conclude), `all_pending` / `none_pending` are a controller's two ways to start
(ControlLoop: a restart waits them all out; the spec's own settings found in force leave none to wait).

Two counters, four cooldowns:
- `intervals_since_change`: the last change other than a queue bound (budget, running cap, replicas).
  SHRINK (a cut after a cut), GROW (a raise, or a running cap restored under pressure) and CAP (a running
  set capped again) wait on it.
- `intervals_since_scale`: the last scale-out/in, shed or restore. SCALE waits on it: the escalation
  ladder, a shed queue reopened, and anything that needs lasting slack.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from stallfree.operator.controller.types import ControllerConfig, Settings, State
from stallfree.operator.controller.verdict import Verdict, hold

SINCE_CHANGE = "intervals_since_change"
SINCE_SCALE = "intervals_since_scale"
COUNTERS = (SINCE_CHANGE, SINCE_SCALE)

_STATE_FIELDS = {f.name for f in fields(State)}
_CONFIG_FIELDS = {f.name for f in fields(ControllerConfig)}


@dataclass(frozen=True, slots=True)
class Cooldown:
    """One cooldown: while `State.<since>` < `ControllerConfig.<length>`, the change it guards holds."""

    name: str
    since: str  # the State counter: intervals since the change it waits out
    length: str  # the ControllerConfig field: how many intervals to wait
    why: str  # the end of a hold's reason ("<what was seen>; <why>")

    def __post_init__(self) -> None:
        if self.since not in COUNTERS or self.since not in _STATE_FIELDS:
            raise ValueError(f"cooldown {self.name}: {self.since!r} is not a State counter {COUNTERS}")
        if self.length not in _CONFIG_FIELDS:
            raise ValueError(f"cooldown {self.name}: {self.length!r} is not a ControllerConfig field")


SHRINK = Cooldown("shrink", SINCE_CHANGE, "shrink_cooldown", "cooling down after the last change")
GROW = Cooldown("grow", SINCE_CHANGE, "grow_cooldown", "cooling down after the last change")
CAP = Cooldown("cap", SINCE_CHANGE, "cap_cooldown", "cooling down after the last change")
SCALE = Cooldown("scale", SINCE_SCALE, "scale_cooldown", "waiting for the last scale/shed to take effect")
COOLDOWNS = (SHRINK, GROW, CAP, SCALE)


def cooling(cd: Cooldown, st: State, cfg: ControllerConfig) -> bool:
    """Whether `cd` still holds: fewer intervals than its length since the change it waits out."""
    return getattr(st, cd.since) < getattr(cfg, cd.length)


def wait_out(cd: Cooldown, s: Settings, why: str) -> Verdict:
    """Hold `s` in cooldown `cd`, saying what was seen (`why`) and what is awaited."""
    return hold(s, f"{why}; {cd.why}")


def tick(st: State) -> State:
    """Every counter one interval further from its change."""
    return replace(st, **{c: getattr(st, c) + 1 for c in COUNTERS})


def restart(st: State, *, change: bool, scale: bool) -> State:
    """The counters a change restarts: `change` for one that is not a queue bound, `scale` for a
    scale-out/in, shed or restore that asks to."""
    zeroed = [c for c, on in ((SINCE_CHANGE, change), (SINCE_SCALE, scale)) if on]
    return replace(st, **dict.fromkeys(zeroed, 0)) if zeroed else st


def all_pending(st: State) -> State:
    """Every cooldown to wait out in full, as right after a change (a restarted controller does not jump)."""
    return replace(st, **dict.fromkeys(COUNTERS, 0))


def none_pending(st: State) -> State:
    """No cooldown to wait out: the counters of a controller that never changed anything."""
    fresh = State()
    return replace(st, **{c: getattr(fresh, c) for c in COUNTERS})
