"""Output sinks. Each format name in the config maps to one exporter class."""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from .base import Exporter, RunInfo

logger = logging.getLogger("trainermon")


class ExporterErrors:
    """Failures of sinks by format, shared by all exporters of a run (the Prometheus sink exports it)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, fmt: str) -> None:
        with self._lock:
            self.counts[fmt] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def _make(fmt: str) -> Exporter:
    if fmt == "csv":
        from .csv import CsvExporter

        return CsvExporter()
    if fmt == "parquet":
        from .parquet import ParquetExporter

        return ParquetExporter()
    if fmt == "prometheus":
        from .prometheus import PrometheusExporter

        return PrometheusExporter()
    if fmt == "tensorboard":
        from .tensorboard import TensorBoardExporter

        return TensorBoardExporter()
    if fmt == "api":
        from .memory import InMemoryExporter

        return InMemoryExporter()
    raise ValueError(f"no exporter for format {fmt!r}")  # config validation lets through known formats


def _counting(method: Callable, fmt: str, errors: ExporterErrors, failed: list) -> Callable:
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception:
            if not failed:  # one failure, one count: not again for the close (and its flush) that follows
                failed.append(True)
                errors.add(fmt)
            raise  # the worker still disables the sink and records the fault

    return call


def build_exporters(run: RunInfo, faults: Any = None) -> list[Exporter]:
    """Instantiate and open the exporters named by `run.config.format`.

    A sink that cannot be created or opened (missing package, port taken, directory not writable) is
    left out with one error message; the other sinks and training go on. With `faults` (the monitor's
    FaultLog) the failure is recorded there; without it, it is logged here, unless every sink failed:
    then the first error is raised, for the caller to record.
    """
    errors = ExporterErrors()
    exporters: list[Exporter] = []
    failures: list[tuple[str, Exception]] = []
    for fmt in run.config.format:
        try:
            exporter = _make(fmt)
            exporter.open(run)
        except Exception as exc:  # noqa: BLE001 - one failing sink must not take the others down
            errors.add(fmt)
            failures.append((fmt, exc))
            continue
        # Count later failures of write/flush/close per format (instance attributes: the class and
        # therefore the worker's messages keep the exporter's own name).
        failed: list = []
        for name in ("write", "flush", "close"):
            setattr(exporter, name, _counting(getattr(exporter, name), fmt, errors, failed))
        exporter.format_name = fmt  # type: ignore[attr-defined]
        exporters.append(exporter)
    if failures and faults is None and not exporters:
        raise failures[0][1]
    for fmt, exc in failures:
        if faults is not None:
            faults.record(f"exporter {fmt} open", exc, f"the {fmt} sink is disabled; training continues")
        else:
            logger.error(
                "trainermon: the %s sink is disabled: it could not be opened: %s: %s",
                fmt,
                type(exc).__name__,
                exc,
            )
    for exporter in exporters:
        attach = getattr(exporter, "attach_error_counts", None)
        if attach is not None:
            attach(errors, list(run.config.format))
    return exporters


__all__ = ["Exporter", "ExporterErrors", "RunInfo", "build_exporters"]
