"""The saved monitoring state (`TrainerMon.state_dict()`): what it holds, how it is applied, and its check
(whole, before any part is applied).

A state is applied in parts (the loop's position, escalation, the anomaly rules' history), some of them
only when `set_monitor` attaches: a part that failed there would leave the others applied and the job
half-restored. `check_state` raises `ValueError` naming the key, the value and what is allowed, on the
call to `load_state_dict` itself, before anything changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("trainermon")
STATE_VERSION = 1
#: Rules that compare against what they saw before (an average or a rolling window): the ones a state
#: without history makes start over
_RULES_WITH_HISTORY = frozenset(
    ("AnomalyTurbulence", "AnomalySpike", "AnomalyUpdateRatio", "AnomalyLogitGrowth")
)


def saved_state(loop: Any) -> dict:
    """`StepLoop.state_dict()`: the loop's position, its escalation and the anomaly rules' history."""
    state = {
        "version": STATE_VERSION,
        "step": loop.step,
        "schedule_collected": loop.schedule.collected,
        "schedule_start": loop.schedule.start,  # dynamic mode: the grid's anchor (None: none yet)
        "dynamic_on": loop.config.dynamic_on,
        "config_digest": loop.control.digest() if loop.control is not None else None,
        "escalation": loop.escalation.state_dict(),
    }
    # Only a history with entries: torch.distributed.checkpoint plans a load from the new monitor's own
    # state_dict, and an empty (or None) entry there would ask for a key the checkpoint may not have
    history = loop.detector.state_dict() if loop.detector is not None else None
    if _has_history(history):
        state["detector"] = history
    return state


def _has_history(history: Any) -> bool:
    """The rules saw values: an average, a window with values, or a count (the windows `set_monitor`
    opens are empty, and a DCP load template holding them would ask for keys a checkpoint may lack)."""
    if not isinstance(history, dict):
        return False
    rolling = history.get("rolling") or {}
    return bool(
        history.get("avg")
        or any(len(entry[1]) for entry in rolling.values())
        or any((history.get("counts") or {}).values())
    )


def restore_state(loop: Any, state: dict) -> None:
    """Apply `state` (checked by `check_state`) to an attached `StepLoop`, whose config is final."""
    loop._pending_state = None  # applied now, whether it came before set_monitor or after
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
    elif state.get("dynamic_on") and state.get("config_digest") is not None:  # a dynamic-mode state
        _say_off_since_saved(loop, state)
    loop.escalation.load_state_dict(state.get("escalation", {}), loop.step)
    if loop.detector is not None:
        history = state.get("detector")
        if history is not None:
            loop.detector.load_state_dict(history)
        remembers = {rule.name for rule in loop.detector.rules} & _RULES_WITH_HISTORY
        if remembers and int(state["schedule_collected"]) > 0 and not _has_history(history):
            # torch.distributed.checkpoint plans its load from the new monitor's (empty) history, so it
            # brings none back: say so, rather than let the rules start over unseen
            logger.warning(
                "trainermon: the loaded state (step %d) holds no anomaly-rule history: the rules start "
                "over and fire only after their warmup. A state saved through torch.distributed.checkpoint "
                "does not keep it (per-rank history); torch.save each rank's monitor.state_dict() instead",
                loop.step,
            )


def _say_off_since_saved(loop: Any, state: dict) -> None:
    """The saved run was collecting and the file now says off. The monitor itself writes that false after
    collect_times, so a job rolled back to a checkpoint taken before then finds it; neither the state nor
    the file records who wrote it (`trainermon off` writes the same bytes), so it is said, not undone."""
    if getattr(loop, "rank", 0) != 0:
        return  # the same on every rank (rank 0's config): once for the job
    logger.warning(
        "trainermon: the state (step %d) was saved while collecting in dynamic mode (%d steps collected; "
        "collect_times is %d in the file now), but %s now says dynamic_on false: nothing is collected "
        "until dynamic_on is set true "
        "(`trainermon on %s`). This false may have been written by this job's own monitor after "
        "collect_times in the run that was rolled back, not by an edit",
        loop.step,
        int(state["schedule_collected"]),
        loop.config.collect_times,
        loop.control.path,
        loop.control.path,
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
    digest = state.get("config_digest")
    if digest is not None and not isinstance(digest, str):
        raise _bad("config_digest", digest, "a string from state_dict(), or null")
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
