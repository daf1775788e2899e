"""Fail-open: an error inside the monitor is logged once per place, counted, and never reaches training."""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("trainermon")


class FaultLog:
    """Counts monitor-internal failures by place; logs the first one of each place with its traceback."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

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
