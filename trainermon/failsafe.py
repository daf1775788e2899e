"""Fail-open: an error inside the monitor is logged once per place, counted, and never reaches training."""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("trainermon")
_MAX_TOLD = 1000  # tensor names `refused` tells of; past that, refusals are only counted


class FaultLog:
    """Counts monitor-internal failures by place; logs the first one of each place with its traceback."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._told: set[str] = set()  # tensors already named by `refused`

    def refused(self, where: str, tensor: str, why: BaseException) -> None:
        """A tensor refused by design (a kind the engine cannot read), not a failure: counted under
        `where` like `record`, told once per tensor name at WARNING, without a traceback. Cost: a lock
        and a set lookup."""
        with self._lock:
            self.counts[where] += 1
            first = tensor not in self._told and len(self._told) < _MAX_TOLD
            if first:
                self._told.add(tensor)
        if first:
            logger.warning(
                "trainermon: unreadable tensor %s: %s; its rows are skipped (told once per tensor, "
                "counted in faults as %r)",
                tensor,
                why,
                where,
            )

    def record(self, where: str, exc: BaseException, consequence: str = "training is not affected") -> None:
        with self._lock:
            self.counts[where] += 1
            first = self.counts[where] == 1
        if first:
            logger.error(
                "trainermon: error in %s: %s: %s (logged once, counted; %s)",
                where,
                type(exc).__name__,
                exc,
                consequence,
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())
