"""set_monitor's arrival check: every rank of the job must call set_monitor (it is collective).

A monitor created on rank 0 only is a common mistake; set_monitor's first collective (a `new_group`) would
then wait for the process group's timeout (30 min by default) without a word. Before that collective each
rank announces itself in the job's rendezvous store (the one `init_process_group` made: TCP, file or
torchrun's agent store, under gloo and NCCL alike; no collective) and waits, at most
`TRAINERMON_SET_MONITOR_TIMEOUT_S` seconds (default 600, within NCCL's and gloo's default group timeouts;
0 or negative: no check), for the others, with a WARNING naming the missing ranks after `WARN_AFTER_S`.
A rank that is late but within that bound is waited for (rank 0 setting up a logger or reading a tokenizer
alone: a job that is only slow is never failed early); past it, set_monitor raises `ConfigError` naming
the ranks that did not arrive.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import os
from typing import Any

from trainermon.config.values import ConfigError

logger = logging.getLogger("trainermon")

TIMEOUT_VAR = "TRAINERMON_SET_MONITOR_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
WARN_AFTER_S = 60.0
LONGEST_S = 1e7  # ~4 months
NAMING_RANKS = 8  # ranks below this name the missing ones (a store look-up per rank)
_PREFIX = "trainermon/set_monitor"

# The n-th set_monitor of this process meets the n-th of every other rank: the count is the same on each
# rank (set_monitor is collective), so no shared counter has to be agreed first, and the keys of a process
# group destroyed and made again over the same store are never reused. torchrun keeps its agent store
# across elastic restarts, where this count starts again: the restart count is part of the key.
_calls = itertools.count()


def timeout_s() -> float:
    """The bound from the environment (read at each set_monitor; a bad value warns and keeps the default)."""
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        logger.warning(
            "trainermon: environment variable %s=%r is not a number of seconds; using %g",
            TIMEOUT_VAR,
            raw,
            DEFAULT_TIMEOUT_S,
        )
        return DEFAULT_TIMEOUT_S
    return min(value, LONGEST_S)  # inf: as good as no limit (a store's wait takes no infinite timedelta)


def _store() -> Any:
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()  # private, but present since torch 1.x
    except Exception:  # noqa: BLE001 - no store to check in (an odd init): the check is skipped
        return None


def wait_for_all(rank: int, world_size: int, timeout: float | None = None) -> None:
    """Block until every rank of the default process group has reached this call, or raise `ConfigError`
    after `timeout` seconds (default: `timeout_s()`) naming the ranks missing. Costs three store round
    trips when all ranks are there (no collective, nothing on any step); nothing with one rank."""
    if world_size <= 1:
        return
    bound = timeout_s() if timeout is None else timeout
    call = next(_calls)
    if bound <= 0:
        return
    store = _store()
    if store is None:
        return
    key = f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{call}"
    store.set(f"{key}/rank{rank}", b"1")  # read only when some rank is missing, to name them
    if store.add(f"{key}/count", 1) >= world_size:
        store.set(f"{key}/all", b"1")  # the last one in lets the others go
        return
    total = bound
    if bound > WARN_AFTER_S:
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=WARN_AFTER_S))
            return
        except Exception:  # noqa: BLE001 - a store's timeout is a RuntimeError or a DistStoreError
            if store.check([f"{key}/all"]):
                return
            logger.warning(
                "trainermon: set_monitor on rank %d has waited %g s for rank(s) %s: set_monitor is "
                "collective (every rank must call it); failing after %g s (%s)",
                rank,
                WARN_AFTER_S,
                _missing(store, key, world_size, rank),
                bound,
                TIMEOUT_VAR,
            )
        bound -= WARN_AFTER_S
    try:
        store.wait([f"{key}/all"], datetime.timedelta(seconds=bound))
    except Exception as exc:  # noqa: BLE001 - a store's timeout is a RuntimeError or a DistStoreError
        if store.check([f"{key}/all"]):  # arrived just now
            return
        shown = _missing(store, key, world_size, rank)
        bound = total
        raise ConfigError(
            f"trainermon: set_monitor is collective: every rank must call it (with the same monitor "
            f"config), but rank(s) {shown} of {world_size} did not within {bound:g} s of rank {rank}. "
            f"Create the TrainerMon and call set_monitor on every rank, not only on rank 0; a rank that "
            f"needs longer to get there: raise {TIMEOUT_VAR} (0 turns this check off)."
        ) from exc


def _missing(store: Any, key: str, world_size: int, rank: int) -> str:
    """The ranks that have not announced themselves under `key`, at most 32 named; looked up by the first
    `NAMING_RANKS` ranks only (one store request per rank: on 1000s of ranks, every waiting rank asking
    would load the store with millions)."""
    if rank >= NAMING_RANKS:
        return f"(named in the logs of ranks 0-{NAMING_RANKS - 1})"
    missing = [r for r in range(world_size) if not store.check([f"{key}/rank{r}"])]
    return ", ".join(map(str, missing[:32])) + (f" and {len(missing) - 32} more" if len(missing) > 32 else "")
