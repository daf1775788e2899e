"""The largest value of a recent time window, for gauges a scrape must not miss between two scrapes.

`trainermon_global_grad_norm` is overwritten at every collected step, and Prometheus samples it once per
scrape interval: a spike that lasts one step is seen by a scrape with a probability of about
(step time / scrape interval). `trainermon_global_grad_norm_max` is the largest value among the
collected steps of the last `prometheus.max_window_s` seconds instead, computed when a scrape renders
the page; nothing is reset by a scrape, so any number of scrapers see the same value.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterator
from typing import Any


class WindowMax:
    """Values added with the time they were added; `current()` is the largest of those of the last
    `seconds`. A deque of values decreasing from front to back (a value that a later, larger one
    outranks is never the maximum again): O(1) amortized per `add`, on the worker thread."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self._queue: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, value: float) -> None:
        """One collected step's value. NaN is left out (it is not a size; TrainermonNonFinite and the
        last-value gauge show it); +Inf counts as the largest value."""
        if math.isnan(value):
            return
        queue = self._queue
        while queue and queue[-1][1] <= value:
            queue.pop()
        queue.append((self.clock(), value))

    def current(self) -> float | None:
        """The largest value added in the last `seconds` (None: none)."""
        queue, cutoff = self._queue, self.clock() - self.seconds
        while queue and queue[0][0] < cutoff:
            queue.popleft()
        return queue[0][1] if queue else None

    def clear(self) -> None:
        self._queue.clear()


class WindowMaxGauge:
    """A collector of a registry: the gauge `name{rank}` at the window's largest value when the registry
    is collected (a scrape renders the page), absent while the window holds no value."""

    def __init__(self, name: str, doc: str, rank: str, window: WindowMax) -> None:
        self.name, self.doc, self.rank, self.window = name, doc, rank, window

    def describe(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(self.name, self.doc, labels=["rank"])

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.name, self.doc, labels=["rank"])
        top = self.window.current()
        if top is not None:
            family.add_metric([self.rank], top)
        yield family
