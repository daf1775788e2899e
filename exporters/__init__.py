"""Output sinks. Each format name in the config maps to one exporter class."""

from __future__ import annotations

from .base import Exporter, RunInfo


def build_exporters(run: RunInfo) -> list[Exporter]:
    """Instantiate and open the exporters named by `run.config.format`."""
    exporters: list[Exporter] = []
    for fmt in run.config.format:
        if fmt == "csv":
            from .csv import CsvExporter

            exporters.append(CsvExporter())
        else:  # config validation only lets through formats this build has
            raise ValueError(f"no exporter for format {fmt!r}")
    for exporter in exporters:
        exporter.open(run)
    return exporters


__all__ = ["Exporter", "RunInfo", "build_exporters"]
