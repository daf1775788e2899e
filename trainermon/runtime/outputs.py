"""Where a rank writes: its run directory, and the sinks the config names (opened fail-open)."""

from __future__ import annotations

import os
import uuid
from datetime import datetime

from trainermon.config import Env, MonitorConfig
from trainermon.failsafe import FaultLog


class Outputs:
    """This rank's run directory (`{MONITOR_OUTPUT_DIR}/{time}-rank{R}-{id}`, msprobe's layout) and its
    exporters. A config that changes the columns or the sinks gets a new directory (`renew`)."""

    def __init__(self, env: Env, rank: int, world_size: int, faults: FaultLog) -> None:
        self.root = env.output_dir
        self.local_rank = env.local_rank
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.coords: dict = {}  # the rank's place in the parallel layout, set by the loop at attach
        self.run_dir = self._new_dir()

    def _new_dir(self) -> str:
        stamp = datetime.now().strftime("%b%d_%H-%M-%S")
        return os.path.join(self.root, f"{stamp}-rank{self.rank}-{uuid.uuid4().hex[:8]}")

    @property
    def run_id(self) -> str:
        return os.path.basename(self.run_dir).rsplit("-", 1)[-1]

    def open(self, config: MonitorConfig) -> list:
        """The configured sinks, opened; one that cannot open is left out, counted and logged."""
        from trainermon.exporters import RunInfo, build_exporters

        run = RunInfo(
            self.run_dir,
            self.root,
            self.rank,
            self.world_size,
            self.run_id,
            config,
            self.local_rank,
            self.coords,
        )
        try:
            return build_exporters(run, faults=self.faults)
        except Exception as exc:  # noqa: BLE001 - a sink that cannot open must not stop training
            self.faults.record("exporter open", exc, "output is off for this run, training continues")
            return []

    def renew(self, config: MonitorConfig) -> list:
        """A new run directory and sinks for it (new columns or sinks after a config change)."""
        self.run_dir = self._new_dir()
        return self.open(config)
