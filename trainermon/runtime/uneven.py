"""torch's Join context for uneven inputs (DDP's `model.join()`, `ZeroRedundancyOptimizer`): a rank that
ran out of batches leaves its training loop and shadows only the joinables' own collectives. Any other
collective from then on waits for that rank forever (or, on the joinables' group, meets a shadow and
corrupts it): the monitor's cross-rank summaries, communication checks and dynamic-control broadcast
pause in such a job; each rank's own rows go on."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("trainermon")


def joining(adapter: Any) -> bool:
    """A Join context was set up over the model or the optimizer. Every rank sets it up at the same point
    of its loop, so every rank sees the same answer at a step boundary. torch leaves the joinable's
    `_join_config.enable` set after the context exits (DDP keeps shadowing), so this stays true."""
    candidates = [*getattr(adapter, "chunks", ()), *adapter.roots(), getattr(adapter, "optimizer", None)]
    return any(getattr(getattr(c, "_join_config", None), "enable", False) for c in candidates)


def say_paused() -> None:
    logger.warning(
        "trainermon: a Join context for uneven inputs (DDP's model.join()) is on: cross-rank summaries, "
        "communication checks and dynamic switching pause for the rest of the run (a rank that has run "
        "out of inputs takes part in no other collective); each rank's own rows go on"
    )
