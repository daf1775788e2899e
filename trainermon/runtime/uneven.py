"""torch's Join context for uneven inputs (DDP's `model.join()`, `ZeroRedundancyOptimizer`): a rank that
ran out of batches leaves its training loop and shadows only the joinables' own collectives. Any other
collective from then on waits for that rank forever (or, on the joinables' group, meets a shadow and
corrupts it): the monitor's cross-rank summaries, communication checks and dynamic-control broadcast
pause in such a job; each rank's own rows go on."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")


def joinables(adapter: Any) -> list[Any]:
    """What a Join context may be set up over: the monitored modules and optimizer, and, when none of them
    is a joinable, a wrapper holding a monitored module (`set_monitor(model.module)` under DDP), found
    once among live objects (~0.1 s on a large process; called once per run, with several ranks)."""
    modules = [*getattr(adapter, "chunks", ()), *adapter.roots()]
    found = [*modules, getattr(adapter, "optimizer", None)]
    if not any(hasattr(c, "_join_config") for c in found):
        held = {id(m) for m in modules}
        found += [
            obj
            for obj in gc.get_objects()
            if issubclass(type(obj), torch.nn.Module)  # type(): lazy proxies warn on __class__
            and hasattr(obj, "_join_config")
            and id(getattr(obj, "module", None)) in held
        ]
    return found


def joining(candidates: list[Any]) -> bool:
    """A Join context was set up over one of `candidates` (`joinables`). Every rank sets it up at the same
    point of its loop, so every rank sees the same answer at a step boundary. torch leaves the joinable's
    `_join_config.enable` set after the context exits (DDP keeps shadowing), so this stays true."""
    return any(getattr(getattr(c, "_join_config", None), "enable", False) for c in candidates)


def say_paused() -> None:
    logger.warning(
        "trainermon: a Join context for uneven inputs (DDP's model.join()) is on: cross-rank summaries, "
        "communication checks and dynamic switching pause for the rest of the run (a rank that has run "
        "out of inputs takes part in no other collective); each rank's own rows go on"
    )
