"""The saved monitoring state (`TrainerMon.state_dict()`), checked whole before any part is applied.

A state is applied in parts (the loop's position, escalation, the anomaly rules' history), some of them
only when `set_monitor` attaches: a part that failed there would leave the others applied and the job
half-restored. `check_state` raises `ValueError` naming the key, the value and what is allowed, on the
call to `load_state_dict` itself, before anything changes.
"""

from __future__ import annotations

import math
from typing import Any

STATE_VERSION = 1


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(f"trainermon: state key {key!r} is {shown}; allowed: {allowed}")


def _whole(key: str, value: Any, least: int) -> None:
    if type(value) is not int or value < least:
        raise _bad(key, value, f"a whole number >= {least}")


def _number(value: Any) -> bool:
    return type(value) in (int, float) and not (isinstance(value, float) and math.isnan(value))


def check_state(state: Any) -> None:
    """Raise ValueError unless `state` is a whole, well-formed `state_dict()` of this version."""
    if not isinstance(state, dict):
        raise ValueError(f"trainermon: a state is a dict from state_dict(), got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise _bad("version", state.get("version"), str(STATE_VERSION))
    for key in ("step", "schedule_collected"):
        _whole(key, state.get(key), 0)
    if "dynamic_on" in state and type(state["dynamic_on"]) is not bool:
        raise _bad("dynamic_on", state["dynamic_on"], "true or false")
    start = state.get("schedule_start")
    if start is not None:
        _whole("schedule_start", start, 0)
    _check_escalation(state.get("escalation", {}))
    if state.get("detector") is not None:
        _check_detector(state["detector"])


def _check_escalation(part: Any) -> None:
    if not isinstance(part, dict):
        raise _bad("escalation", part, 'a dict {"until": step, "pending": [steps, ...]}')
    _whole("escalation.until", part.get("until", -1), -1)
    pending = part.get("pending", [])
    if not isinstance(pending, (list, tuple)):
        raise _bad("escalation.pending", pending, "a list of whole numbers >= 1")
    for n in pending:
        _whole("escalation.pending", n, 1)


def _check_detector(part: Any) -> None:
    if not isinstance(part, dict):
        raise _bad("detector", part, 'a dict {"counts": ..., "avg": ..., "rolling": ...}')
    counts = part.get("counts", {})
    if not isinstance(counts, dict) or not all(type(n) is int and n >= 0 for n in counts.values()):
        raise _bad("detector.counts", counts, "a dict of rule name -> whole number >= 0")
    avg = part.get("avg", {})
    if not isinstance(avg, dict) or not all(
        isinstance(v, (tuple, list)) and len(v) == 2 and _number(v[0]) and type(v[1]) is int
        for v in avg.values()
    ):
        raise _bad("detector.avg", avg, "a dict of key -> (mean, count)")
    rolling = part.get("rolling", {})
    if not isinstance(rolling, dict):
        raise _bad("detector.rolling", rolling, "a dict of key -> (window, [values])")
    for key, entry in rolling.items():
        ok = isinstance(entry, (tuple, list)) and len(entry) == 2
        ok = ok and type(entry[0]) is int and entry[0] >= 1 and isinstance(entry[1], (list, tuple))
        if not ok or not all(_number(v) for v in entry[1]):
            raise _bad(f"detector.rolling[{key!r}]", entry, "(window >= 1, [numbers])")
