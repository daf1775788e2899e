"""`"format": "api"` (msprobe's name for it): no files and no server. A collected step's statistics are
read in memory, after the optimizer step, through `TrainerMon.generate_wgrad_metrics()` and
`generate_xy_metrics()` (`trainermon.inmemory`); the monitor keeps the last finished step whatever the
format, so this sink has nothing to keep."""

from __future__ import annotations

from trainermon.collect.records import StatBatch

from .base import Exporter


class InMemoryExporter(Exporter):
    def write(self, batch: StatBatch) -> None:
        """Nothing to write: the step loop keeps the last finished step (`TrainerMon.last_batch`)."""
