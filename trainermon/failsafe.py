"""Fail-open: an error inside the monitor is logged once per place, counted, and never reaches training."""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("trainermon")
F = TypeVar("F", bound=Callable[..., Any])


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

    def guarded(self, where: str, fallback: Any = None) -> Callable[[F], F]:
        """Decorator: run the function; on any Exception record it and return `fallback`."""

        def wrap(fn: F) -> F:
            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - the whole point is to never propagate
                    self.record(where, exc)
                    return fallback

            return inner  # type: ignore[return-value]

        return wrap
