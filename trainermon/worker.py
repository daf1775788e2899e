"""Background worker: finalises statistics and feeds the exporters off the training thread.

The queue is bounded. When it is full the step's records are dropped and counted (`dropped_rows`),
never silently, and the training thread never waits for I/O.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from .failsafe import FaultLog
from .records import StatBatch, StepPayload
from .stats import finalize

logger = logging.getLogger("trainermon")
_STOP = object()


class BackgroundWorker:
    def __init__(
        self,
        exporters: Sequence,
        faults: FaultLog,
        queue_size: int = 64,
        observers: Sequence[Callable[[StatBatch], None]] = (),
    ) -> None:
        self.exporters = list(exporters)
        self.observers = list(observers)
        self.faults = faults
        self.dropped_rows = 0
        self.written_batches = 0
        self._disabled: set[int] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="trainermon-worker", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, payload: StepPayload) -> bool:
        """Hand a step to the worker without blocking. Returns False (and counts) when the queue is full."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(payload)
            return True
        except queue.Full:
            self.dropped_rows += len(payload.rows)
            if self.dropped_rows == len(payload.rows):
                logger.warning(
                    "trainermon: the output queue is full (exporters are slower than training); "
                    "records are being dropped and counted"
                )
            return False

    def replace_exporters(self, exporters: Sequence) -> None:
        """Switch to new exporters after the steps already queued are written (a config change)."""
        if not self._closed:
            self._queue.put(("swap", list(exporters)))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every submitted step is written and every exporter flushed, or `timeout` passes
        (a hung sink: a warning, never an exception)."""
        if self._closed or not self._thread.is_alive():
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            logger.warning("trainermon: flush gave up after %s s: the output queue stayed full", timeout)
            return
        if not done.wait(timeout):
            logger.warning("trainermon: flush gave up after %s s: an exporter is still writing", timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the worker and close the exporters; at most `timeout` seconds.

        A sink that hangs (a dead network filesystem) is left to its daemon thread: its exporters are not
        closed under it, and the caller (often the interpreter's exit) is not held."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            deadline = time.monotonic() + timeout
            try:
                self._queue.put(_STOP, timeout=timeout)
                self._thread.join(max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
            if self._thread.is_alive():
                logger.error(
                    "trainermon: an exporter did not finish within %s s; leaving it to its thread", timeout
                )
                return
        self._close_exporters()

    def _close_exporters(self) -> None:
        for i, exporter in enumerate(self.exporters):
            if i in self._disabled:
                continue
            try:
                exporter.close()
            except Exception as exc:  # noqa: BLE001
                self.faults.record(f"exporter {type(exporter).__name__}.close", exc)

    # ---- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._flush_exporters()
                return
            if isinstance(item, threading.Event):
                self._flush_exporters()
                item.set()
                continue
            if isinstance(item, tuple) and item[0] == "swap":
                self._close_exporters()
                self.exporters, self._disabled = item[1], set()
                continue
            try:
                batch = self._finalize(item)
            except Exception as exc:  # noqa: BLE001
                self.faults.record("worker finalize", exc)
                continue
            for observer in self.observers:
                try:
                    observer(batch)
                except Exception as exc:  # noqa: BLE001
                    self.faults.record(f"observer {getattr(observer, '__name__', observer)}", exc)
            self._export(batch)
            self.written_batches += 1

    def _finalize(self, payload: StepPayload) -> StatBatch:
        if payload.ready is not None:
            payload.ready.synchronize()
        partials = payload.partials.numpy()
        numel = np.fromiter((r.numel for r in payload.rows), dtype=np.float64, count=len(payload.rows))
        values = finalize(partials, numel)
        extras = {k: float(v) for k, v in payload.extras.items()}
        # Global gradient norm from the per-parameter sums of squares (exact across shards, since each
        # row is already the full parameter's merged statistic).
        reduced = [i for i, r in enumerate(payload.rows) if r.family == "grad_reduced"]
        if reduced:
            extras["global_grad_norm"] = float(np.sqrt(np.sum(partials[reduced, 0].astype(np.float64))))
        extras["dropped_rows"] = float(self.dropped_rows)
        extras["monitor_faults"] = float(self.faults.total)
        return StatBatch(step=payload.step, rows=payload.rows, values=values, extras=extras)

    def _export(self, batch: StatBatch) -> None:
        for i, exporter in enumerate(self.exporters):
            if i in self._disabled:
                continue
            try:
                exporter.write(batch)
            except Exception as exc:  # noqa: BLE001
                # A failing sink (disk full, permission denied) is switched off; the others go on.
                self._disabled.add(i)
                self.faults.record(
                    f"exporter {type(exporter).__name__}",
                    exc,
                    "this exporter is disabled, the others continue",
                )
                _close_quietly(exporter)  # release its files and sockets

    def _flush_exporters(self) -> None:
        for i, exporter in enumerate(self.exporters):
            if i in self._disabled:
                continue
            try:
                exporter.flush()
            except Exception as exc:  # noqa: BLE001
                self._disabled.add(i)
                self.faults.record(f"exporter {type(exporter).__name__}.flush", exc)
                _close_quietly(exporter)


def _close_quietly(exporter) -> None:
    try:
        exporter.close()
    except Exception:  # noqa: BLE001 - already failed and counted once; closing is best effort
        pass
