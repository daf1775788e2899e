"""The monitor's own time on the training thread (the `monitor_time_ms` column and the benchmarks' figure):
the step events and the step boundary, every batch of rows added from a gradient tap, and the whole body
of every activation hook (`HookedModule.pre` and `forward`, `GradRows`), not only the rows it adds. Left out:
PyTorch's dispatch to a hook (measured as the `hooks` arm of benchmarks/activation_floor.py)."""

from __future__ import annotations

import time
from threading import get_ident


class OwnTime:
    """Sums wall time inside `with clock:` blocks; nested blocks (a hook inside a step event) count once.

    Costs two `perf_counter` calls and a `get_ident` per outermost block. Not thread-safe: the training
    thread only.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self._depth = 0
        self._entered = 0.0
        self._owner = 0  # the thread that entered the outermost block

    @property
    def busy(self) -> bool:
        """True inside a block: the monitor's own work (its collectives are not the job's)."""
        return self._depth > 0

    def busy_here(self) -> bool:
        """True inside a block entered by the calling thread: its collectives are the monitor's own (one
        made meanwhile on another thread, as a hook's Future callback on gloo's, is the job's)."""
        return self._depth > 0 and self._owner == get_ident()

    def __enter__(self) -> OwnTime:
        if self._depth == 0:
            self._entered = time.perf_counter()
            self._owner = get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.total_s += time.perf_counter() - self._entered

    def now(self) -> float:
        """The running total, including the block in progress."""
        if self._depth:
            return self.total_s + (time.perf_counter() - self._entered)
        return self.total_s
