"""Background worker: hands each submitted step to the deriver, its observers and the exporters, off the
training thread. Transport only: what a step becomes is `derive.Deriver`'s job.

Steps are handed over in batches. `submit` only appends to a list; the worker wakes every
`interval_s` (config `write_interval_s`; or when the list is half full, or for a flush) and writes
everything waiting in one go; with an interval of 0 it wakes for every step.
Why not wake per step: the worker's work is Python, so it needs the GIL, and a training thread whose
forward and backward passes are Python between short kernels (or kernel launches, on a GPU) takes the GIL
back hundreds of times per step. Each wake-up of the worker then costs the training thread far more than
the worker's own CPU time (measured in docs/PERFORMANCE.md: about three times), while one wake-up per
batch of steps costs about the work itself.

The list is bounded (`queue_size` steps). When it is full the step's records are dropped and counted
(`dropped_rows`), never silently, and the training thread never waits for I/O.

A sink stuck in one call for `HUNG_S` (a dead network filesystem) is switched off: the next `submit` or a
waiting `flush` notices, counts a fault and starts a new worker thread that goes on with the other sinks
(from the rest of the step being written). The stuck thread, should its call ever return, stops there.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from trainermon.collect.records import StatBatch, StepPayload
from trainermon.config.schema import MonitorConfig
from trainermon.failsafe import FaultLog

logger = logging.getLogger("trainermon")
_STOP = object()
_COLLECTION_STOPPED = object()  # `collection_stopped()`: each sink's optional hook of that name
_STOP_CLOSE = object()  # `close()` called on the worker thread itself: it writes, closes the sinks, stops

WRITE_INTERVAL_S = MonitorConfig.write_interval_s  # the config default
#: Seconds one exporter call may take before its sink counts as hung and is switched off.
HUNG_S = 30.0


class _Swap(NamedTuple):
    """Queue item: close the current exporters and continue with these."""

    exporters: list


class _Reached(NamedTuple):
    """Queue item: every step before it is derived and written to the exporters (not flushed)."""

    done: threading.Event


class _Resume(NamedTuple):
    """What a replacement worker thread finishes first: the call (`write` or `flush`) the stuck thread was
    making, on the exporters after the stuck one, then the queue item it was serving (`done`)."""

    what: str
    batch: StatBatch | None
    first: int
    done: object  # a flush's Event to set, _STOP to stop after, or None


class BackgroundWorker:
    def __init__(
        self,
        exporters: Sequence,
        faults: FaultLog,
        derive: Callable[[StepPayload], StatBatch],
        queue_size: int = 64,
        observers: Sequence[Callable[[StatBatch], None]] = (),
        interval_s: float = WRITE_INTERVAL_S,
    ) -> None:
        """`observers` are fixed here, before the thread starts (they run on it, after `derive`)."""
        self.exporters = list(exporters)
        self.observers = tuple(observers)
        self.derive = derive
        self.faults = faults
        self.dropped_rows = 0
        self.written_batches = 0
        self.interval_s = interval_s
        self._disabled: set[int] = set()
        self._queue_size = queue_size
        self._wake_at = max(1, queue_size // 2)
        # Appends and pops of a deque are atomic, so the training thread takes no lock and wakes nobody.
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        # The exporter call under way: (thread generation, exporter index, monotonic start), and what a
        # replacement would resume; a thread whose generation is no longer current stops (`_check_hung`).
        self._busy: tuple[int, int, float] | None = None
        self._call: tuple[str, StatBatch | None, object] = ("write", None, None)
        self._generation = 0
        self._hung_lock = threading.Lock()
        self.pid = os.getpid()  # a forked child has no worker thread: close() there touches nothing
        self._thread = self._start(None)

    def _start(self, resume: _Resume | None) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, args=(self._generation, resume), name="trainermon-worker", daemon=True
        )
        thread.start()
        return thread

    def submit(self, payload: StepPayload) -> bool:
        """Hand a step to the worker. Never blocks; usually wakes no thread, and takes a lock only while an
        exporter call is under way (to see whether it hung). Returns False (and counts the rows as
        dropped) when `queue_size` steps are already waiting."""
        if self._closed:
            return False
        if self._busy is not None:
            self._check_hung()
        waiting = len(self._pending)
        if waiting >= self._queue_size:
            self._wake.set()
            self.dropped_rows += len(payload.rows)
            if self.dropped_rows == len(payload.rows):
                logger.warning(
                    "trainermon: the output queue is full (exporters are slower than training); "
                    "records are being dropped and counted"
                )
            return False
        self._pending.append(payload)
        if waiting + 1 >= self._wake_at or self.interval_s <= 0:
            self._wake.set()
        return True

    def set_interval(self, seconds: float) -> None:
        """Change how often the worker writes (a reloaded config); takes effect at once."""
        self.interval_s = seconds
        self._wake.set()

    def replace_exporters(self, exporters: Sequence) -> None:
        """Switch to new exporters after the steps already queued are written (a config change)."""
        if not self._closed:
            self._pending.append(_Swap(list(exporters)))

    def collection_stopped(self) -> None:
        """Tell the sinks, after the steps already queued, that collection stopped (dynamic_on off, or
        collect_times reached): a sink with a `collection_stopped()` method (optional, like `tick`) drops
        values that would read as current; the next step written means collection is on again."""
        if not self._closed:
            self._pending.append(_COLLECTION_STOPPED)
            self._wake.set()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every submitted step is written and every exporter flushed, or `timeout` passes
        (a hung sink: a warning, never an exception). A sink hung for HUNG_S is switched off meanwhile,
        so a flush waits at most about HUNG_S for it."""
        self._wait(threading.Event(), timeout, "flush")

    def reached(self, timeout: float | None = None) -> None:
        """Block until every submitted step is derived and handed to the exporters, without flushing
        them (a Parquet part stays open: a per-step call does not cut one part per step)."""
        done = threading.Event()
        self._wait(_Reached(done), timeout, "wait", done)

    def _wait(self, item: Any, timeout: float | None, what: str, done: Any = None) -> None:
        if self._closed or not self._thread.is_alive():
            return
        done = item if done is None else done
        self._pending.append(item)
        self._wake.set()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while not done.wait(min(HUNG_S / 4, max(0.0, deadline - time.monotonic()))):
            self._check_hung()
            if time.monotonic() >= deadline:
                logger.warning(
                    "trainermon: %s gave up after %s s: an exporter is still writing", what, timeout
                )
                return

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the worker and close the exporters.

        A sink stuck in one call for HUNG_S is switched off meanwhile, as during the run, so the other
        sinks still write and close what they hold; each exporter's `close()` gets HUNG_S on a thread of
        its own. The wait for the writing is at most `timeout` seconds; by default HUNG_S + 10, renewed
        each time a sink is switched off (a dead mount hangs every file sink: each costs HUNG_S, and the
        sinks after it still write). A sink still stuck then is left to its daemon thread, and the caller
        (often the interpreter's exit) is not held.

        In a forked child it does nothing (the parent writes the queued steps and owns the sinks). Called on
        the worker thread itself (a finalizer the garbage collector ran there) it only asks the thread to
        write, close the sinks and stop (`stopping`, `wait_stopped`)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        if threading.current_thread() is self._thread:
            self._pending.append(_STOP_CLOSE)
            self._wake.set()
            return
        renew = timeout is None
        timeout = HUNG_S + 10 if timeout is None else timeout
        if self._thread.is_alive():
            self._pending.append(_STOP)
            self._wake.set()
            deadline = time.monotonic() + timeout
            # In slices: a stuck sink is noticed here, and a new thread finishes the others' work.
            while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
                self._thread.join(min(HUNG_S / 4, left))
                off = len(self._disabled)
                self._check_hung()
                if renew and len(self._disabled) > off:
                    deadline = max(deadline, time.monotonic() + HUNG_S + 10)
            if self._thread.is_alive():
                logger.error(
                    "trainermon: an exporter did not finish within %s s; leaving it to its thread", timeout
                )
                return
        self._close_each_bounded()

    def stopping(self) -> bool:
        """The worker thread was asked by itself to stop (see `close`) and is still running."""
        return self._closed and self._thread.is_alive()

    def wait_stopped(self, timeout: float = HUNG_S + 10) -> None:
        """Wait (at most `timeout` s; a hung sink is switched off meanwhile) until the thread stopped."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            self._thread.join(min(HUNG_S / 4, left))
            self._check_hung()

    def _close_each_bounded(self) -> None:
        """Close the exporters that are on, each on a daemon thread for at most HUNG_S: one stuck in its
        `close()` (a dead mount) is counted and left, and the others are still closed."""
        for i, exporter in enumerate(self.exporters):
            if i in self._disabled:
                continue
            closer = threading.Thread(
                target=self._close_one, args=(exporter,), name="trainermon-close", daemon=True
            )
            closer.start()
            closer.join(HUNG_S)
            if closer.is_alive():
                self.faults.record(
                    f"exporter {type(exporter).__name__}.close hung",
                    TimeoutError(f"close() has not returned for {HUNG_S:g} s (a dead filesystem or server?)"),
                    "left to its thread; the other exporters are closed",
                )

    def _close_one(self, exporter: Any) -> None:
        try:
            exporter.close()
        except Exception as exc:  # noqa: BLE001
            self.faults.record(f"exporter {type(exporter).__name__}.close", exc)

    def _check_hung(self) -> None:
        """Any thread: a sink stuck in one call for HUNG_S is switched off (a counted fault), and a new
        worker thread finishes that call's work on the other sinks, then serves the queue."""
        with self._hung_lock:
            busy = self._busy
            if busy is None or busy[0] != self._generation or time.monotonic() - busy[2] < HUNG_S:
                return
            _, index, _ = busy
            what, batch, done = self._call
            self._generation += 1  # the stuck thread stops if its call ever returns
            self._busy = None
            self._disabled.add(index)
            exporter = self.exporters[index]
            self.faults.record(
                f"exporter {type(exporter).__name__} hung",
                TimeoutError(
                    f"a {what} call has not returned for {HUNG_S:g} s (a dead filesystem or server?)"
                ),
                "this exporter is disabled, the others continue on a new worker thread",
            )
            self._thread = self._start(_Resume(what, batch, index + 1, done))

    def _close_exporters(self) -> None:
        for i, exporter in enumerate(self.exporters):
            if i in self._disabled:
                continue
            try:
                exporter.close()
            except Exception as exc:  # noqa: BLE001
                self.faults.record(f"exporter {type(exporter).__name__}.close", exc)

    # ---- worker thread -----------------------------------------------------------------------
    def _run(self, generation: int, resume: _Resume | None) -> None:
        if resume is not None:
            if not self._each(generation, resume.what, resume.batch, resume.first, resume.done):
                return  # replaced again
            if resume.what == "write":
                self.written_batches += 1
            if resume.done is _STOP:
                return
            if isinstance(resume.done, threading.Event):
                resume.done.set()
        while True:
            self._wake.wait(self._timeout())
            self._wake.clear()  # before draining: a wake-up for an item appended later is not lost
            while self._pending:
                if not self._handle(self._pending.popleft(), generation):
                    return
            if self._ticking() and not self._each(generation, "tick", None, 0, None):
                return

    def _ticking(self) -> list[float]:
        """The `tick_s` of the exporters that are on (a Parquet sink's seconds_per_part)."""
        return [
            t
            for i, e in enumerate(self.exporters)
            if i not in self._disabled and (t := getattr(e, "tick_s", None)) is not None
        ]

    def _timeout(self) -> float | None:
        """How long the thread sleeps with nothing queued: the write interval, and no longer than the
        shortest `tick_s` (None: until woken)."""
        bounds = [t for t in (self.interval_s or None, *self._ticking()) if t]
        return min(bounds) if bounds else None

    def _handle(self, item, generation: int) -> bool:
        """Process one queue item; False when this thread is to stop (the worker's end, or replaced)."""
        if item is _STOP:
            self._each(generation, "flush", None, 0, item)
            return False
        if item is _STOP_CLOSE:
            if self._each(generation, "flush", None, 0, _STOP):
                self._close_exporters()
            return False
        if isinstance(item, threading.Event):
            if not self._each(generation, "flush", None, 0, item):
                return False
            item.set()
            return True
        if isinstance(item, _Reached):
            item.done.set()
            return True
        if item is _COLLECTION_STOPPED:
            return self._each(generation, "collection_stopped", None, 0, None)
        if isinstance(item, _Swap):
            self._close_exporters()
            self.exporters, self._disabled = item.exporters, set()
            return True
        try:
            batch = self.derive(item)
        except Exception as exc:  # noqa: BLE001
            self.faults.record("worker finalize", exc)
            return True
        for observer in self.observers:
            try:
                observer(batch)
            except Exception as exc:  # noqa: BLE001
                self.faults.record(f"observer {getattr(observer, '__name__', observer)}", exc)
        if not self._each(generation, "write", batch, 0, None):
            return False
        self.written_batches += 1
        return True

    def _each(self, generation: int, what: str, batch: StatBatch | None, first: int, done: object) -> bool:
        """`exporter.write(batch)` or `exporter.flush()` on exporters `first`... that are on; one that
        raises (disk full, permission denied) is switched off, the others go on. Each call is tracked for
        `_check_hung`; False when this thread was replaced meanwhile (it then touches nothing more)."""
        self._call = (what, batch, done)
        for i in range(first, len(self.exporters)):
            if i in self._disabled:
                continue
            exporter = self.exporters[i]
            self._busy = (generation, i, time.monotonic())
            try:
                if what == "write":
                    exporter.write(batch)
                elif what in ("tick", "collection_stopped"):  # optional hooks
                    getattr(exporter, what, _nothing)()
                else:
                    exporter.flush()
            except Exception as exc:  # noqa: BLE001
                if generation != self._generation:
                    return False
                self._disabled.add(i)
                suffix = "" if what == "write" else f".{what}"
                self.faults.record(
                    f"exporter {type(exporter).__name__}{suffix}",
                    exc,
                    "this exporter is disabled, the others continue",
                )
                _close_quietly(exporter)  # release its files and sockets
            with self._hung_lock:
                if generation != self._generation:
                    return False
                self._busy = None
        return True


def _nothing() -> None:
    pass


def _close_quietly(exporter) -> None:
    try:
        exporter.close()
    except Exception:  # noqa: BLE001 - already failed and counted once; closing is best effort
        pass
