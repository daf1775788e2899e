"""The saved monitoring state (`TrainerMon.state_dict()`): what it holds, how it is applied, and its check
(whole, before any part is applied).

A state is applied in parts (the loop's position, escalation, the anomaly rules' history), some of them
only when `set_monitor` attaches: a part that failed there would leave the others applied and the job
half-restored. `check_state` raises `ValueError` naming the key, the value and what is allowed, on the
call to `load_state_dict` itself, before anything changes.

The state is per rank. The anomaly rules' history (nested dicts keyed by data-dependent tuples) is one
opaque JSON string under a key that names the rank, `detector_rank{R}` (version 2): the new monitor's own
`state_dict()` has that key, so `torch.distributed.checkpoint`, which plans a load from it and keeps one
copy of each non-tensor key across ranks, brings every rank back its own history. Version 1 (the plain
nested `detector` dict, saved per rank with torch.save) still loads.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

logger = logging.getLogger("trainermon")
STATE_VERSION = 2
VERSIONS = (1, 2)  # 1: the history as a nested "detector" dict
_RANK_KEY = re.compile(r"detector_rank(\d+)")


def history_key(rank: int) -> str:
    """The key of rank `rank`'s anomaly history in a saved state."""
    return f"detector_rank{rank}"


def _encode(step: int, part: dict | None) -> str:
    """The detector's history as JSON: tuple keys as lists, so that it round-trips through any checkpoint.
    Costs O(history) once per save (the rules' window of values per monitored statistic), nothing per step."""
    part = part or {}
    return json.dumps(
        {
            "step": step,
            "counts": dict(part.get("counts", {})),
            "avg": [[list(k), v[0], v[1]] for k, v in part.get("avg", {}).items()],
            "rolling": [[list(k), w, list(vals)] for k, (w, vals) in part.get("rolling", {}).items()],
        }
    )


def _tuple(key: Any) -> Any:
    return tuple(_tuple(k) for k in key) if isinstance(key, list) else key


def decode_history(key: str, text: Any) -> tuple[int, dict]:
    """(the step it was saved at, the detector's `state_dict()`) from a `detector_rank{R}` entry; raises
    ValueError naming the key unless it is one from `state_dict()`."""
    allowed = 'a JSON string {"step": n, "counts": {...}, "avg": [...], "rolling": [...]} from state_dict()'
    try:
        raw = json.loads(text) if isinstance(text, (str, bytes)) else None
        ok = isinstance(raw, dict) and type(raw.get("step")) is int and raw["step"] >= 0
        part = {
            "counts": raw["counts"],
            "avg": {_tuple(k): (mean, n) for k, mean, n in raw["avg"]},
            "rolling": {_tuple(k): (w, vals) for k, w, vals in raw["rolling"]},
        }
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise _bad(key, text, allowed)
    _check_detector(part, key)
    return raw["step"], part


def saved_state(loop: Any) -> dict:
    """`StepLoop.state_dict()`: the loop's position, its escalation and this rank's anomaly rules' history
    (always under this rank's key, empty before `set_monitor`, so that a DCP load asks for it)."""
    detector = loop.detector.state_dict() if loop.detector is not None else None
    return {
        "version": STATE_VERSION,
        "step": loop.step,
        "schedule_collected": loop.schedule.collected,
        "schedule_start": loop.schedule.start,  # dynamic mode: the grid's anchor (None: none yet)
        "dynamic_on": loop.config.dynamic_on,
        "config_digest": loop.control.digest() if loop.control is not None else None,
        "escalation": loop.escalation.state_dict(),
        history_key(loop.rank): _encode(loop.step, detector),
    }


def restore_state(loop: Any, state: dict) -> None:
    """Apply `state` (checked by `check_state`) to an attached `StepLoop`, whose config is final."""
    given = getattr(loop, "start_iteration", 0)  # what set_monitor was given (0: none)
    loop.step = loop.first_step = int(state["step"])  # a resumed run counts its steps from here
    if given not in (0, loop.step):  # start_iteration given, and another step than the state's
        logger.warning(
            "trainermon: set_monitor's start_iteration %d differs from the saved state's step %d: the "
            "state's step numbers this run (a state from another checkpoint than the one resumed?)",
            given,
            loop.step,
        )
    control = loop.control
    # Dynamic mode: the file decides (switched or edited while the job was down, it holds); the count
    # toward collect_times and the grid go on only where the saved run ran this same config.
    if control is None or (
        bool(state.get("dynamic_on")) == loop.config.dynamic_on
        and state.get("config_digest") in (None, control.digest())  # None: saved before digests
    ):
        loop.schedule.collected = int(state["schedule_collected"])
        if control is not None:  # the saved run's anchor (not re-anchored); none saved: the resumed step
            start = state.get("schedule_start")
            loop.schedule.resume(loop.step if start is None else int(start))
    elif loop.config.dynamic_on:
        # A new config from the resumed step, wherever `set_monitor` anchored it: loaded after it without
        # `start_iteration` (Megatron's insertion), the grid started at step 0 and ran off the resumed step
        loop.schedule.collected = 0
        loop.schedule.resume(loop.step)
        logger.info(
            "trainermon: the config file changed since the state was saved: it applies from step %d, "
            "its collect_times counted from there",
            loop.step,
        )
    loop.escalation.load_state_dict(state.get("escalation", {}), loop.step)
    if loop.detector is not None:
        _restore_history(loop, state)


def _restore_history(loop: Any, state: dict) -> None:
    """This rank's history: its own `detector_rank{R}` entry, or a version-1 state's `detector`. A state
    of other ranks only (rank 0's on a rank the saving job did not have; Lightning saves rank 0's for all)
    gives the lowest rank's, as version 1 did, said once: its baselines are that rank's. None at all
    (also a DCP load that left the new monitor's own empty entry in place): the rules start over, said
    once when they would have had one."""
    own = history_key(loop.rank)
    held = sorted(int(m.group(1)) for k in state if (m := _RANK_KEY.fullmatch(str(k))))
    key = own if own in state else history_key(held[0]) if held else None
    part = state.get("detector")  # version 1
    if key is not None:
        saved_at, part = decode_history(key, state[key])
        part = part if saved_at == int(state["step"]) else None  # not saved with this state: a template
    loop.detector.load_state_dict(part or {})
    if not loop.detector.rules or int(state["step"]) == 0 or (part is not None and key in (None, own)):
        return
    if part is not None:
        logger.warning(
            "trainermon: the saved state holds no anomaly history for rank %d: the rules go on from rank "
            "%d's (saved by another rank or world size; save each rank's state for its own)",
            loop.rank,
            held[0],
        )
        return
    logger.warning(
        "trainermon: the saved state holds no anomaly history for rank %d (it holds rank(s) %s): the "
        "rules start over at step %d and fire again after their warmup (a DCP load that did not read "
        "key %r: a state from another world size?)",
        loop.rank,
        held or "none",
        loop.step,
        own,
    )


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
    """Raise ValueError unless `state` is a whole, well-formed `state_dict()` of a known version."""
    if not isinstance(state, dict):
        raise ValueError(f"trainermon: a state is a dict from state_dict(), got {type(state).__name__}")
    if state.get("version") not in VERSIONS:
        raise _bad("version", state.get("version"), " or ".join(map(str, VERSIONS)))
    for key in ("step", "schedule_collected"):
        _whole(key, state.get(key), 0)
    if "dynamic_on" in state and type(state["dynamic_on"]) is not bool:
        raise _bad("dynamic_on", state["dynamic_on"], "true or false")
    start = state.get("schedule_start")
    if start is not None:
        _whole("schedule_start", start, 0)
    digest = state.get("config_digest")
    if digest is not None and not isinstance(digest, str):
        raise _bad("config_digest", digest, "a string from state_dict(), or null")
    _check_escalation(state.get("escalation", {}))
    if state.get("detector") is not None:  # version 1
        _check_detector(state["detector"])
    for key in state:
        if _RANK_KEY.fullmatch(str(key)):
            decode_history(key, state[key])


def _check_escalation(part: Any) -> None:
    if not isinstance(part, dict):
        raise _bad("escalation", part, 'a dict {"until": step, "pending": [steps, ...]}')
    _whole("escalation.until", part.get("until", -1), -1)
    pending = part.get("pending", [])
    if not isinstance(pending, (list, tuple)):
        raise _bad("escalation.pending", pending, "a list of whole numbers >= 1")
    for n in pending:
        _whole("escalation.pending", n, 1)


def _check_detector(part: Any, name: str = "detector") -> None:
    if not isinstance(part, dict):
        raise _bad(name, part, 'a dict {"counts": ..., "avg": ..., "rolling": ...}')
    counts = part.get("counts", {})
    if not isinstance(counts, dict) or not all(type(n) is int and n >= 0 for n in counts.values()):
        raise _bad(f"{name}.counts", counts, "a dict of rule name -> whole number >= 0")
    avg = part.get("avg", {})
    if not isinstance(avg, dict) or not all(
        isinstance(v, (tuple, list)) and len(v) == 2 and _number(v[0]) and type(v[1]) is int
        for v in avg.values()
    ):
        raise _bad(f"{name}.avg", avg, "a dict of key -> (mean, count)")
    rolling = part.get("rolling", {})
    if not isinstance(rolling, dict):
        raise _bad(f"{name}.rolling", rolling, "a dict of key -> (window, [values])")
    for key, entry in rolling.items():
        ok = isinstance(entry, (tuple, list)) and len(entry) == 2
        ok = ok and type(entry[0]) is int and entry[0] >= 1 and isinstance(entry[1], (list, tuple))
        if not ok or not all(_number(v) for v in entry[1]):
            raise _bad(f"{name}.rolling[{key!r}]", entry, "(window >= 1, [numbers])")
