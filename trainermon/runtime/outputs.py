"""Where a rank writes: its run directory, and the sinks the config names (opened fail-open)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from trainermon.config import Env, MonitorConfig
from trainermon.failsafe import FaultLog


class Outputs:
    """This rank's run directory (`{MONITOR_OUTPUT_DIR}/{time}-rank{R}-{id}`, msprobe's layout) and its
    exporters. A config that changes the columns or the sinks gets a new directory (`renew`).

    The `{id}` part is the run id. msprobe draws it on each rank (8 hex digits of a uuid4), so the ranks
    of one job share nothing in their output; here rank 0 draws it and `share` hands it, with rank 0's
    start time and UTC offset, to every rank at `set_monitor` (one broadcast), so every rank's directory
    (whatever its node's timezone), Parquet rows and Prometheus labels carry the same job-wide id."""

    def __init__(self, env: Env, rank: int, world_size: int, faults: FaultLog) -> None:
        self.root = env.output_dir
        self.local_rank = env.local_rank
        self.env = env
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.coords: dict = {}  # the rank's place in the parallel layout, set by the loop at attach
        #: msprobe's tag kind of grad_unreduced rows, given monitor_mbs_grad (the adapter's, set at attach)
        self.unreduced_kind: Callable[[bool], str] = lambda per_micro_batch: "pre_grad"
        self.run_id = uuid.uuid4().hex[:8]
        self._started = int(time.time())
        # {time} is written in rank 0's local time on every rank (the offset is shared with the id): nodes
        # whose TZ differs (a UTC container on a local-time host) would otherwise name the job's folders
        # differently. Fixed for the run, so a renewed folder of a job crossing a DST change matches too.
        self._utc_offset = int(datetime.fromtimestamp(self._started).astimezone().utcoffset().total_seconds())
        self.run_dir = self._new_dir()

    def _new_dir(self) -> str:
        zone = timezone(timedelta(seconds=self._utc_offset))
        stamp = datetime.fromtimestamp(self._started, tz=zone).strftime("%b%d_%H-%M-%S")
        return os.path.join(self.root, f"{stamp}-rank{self.rank}-{self.run_id}")

    def share(self, group: Any) -> None:
        """Collective over `group`, a CPU (gloo) group of every rank (None: not distributed; every rank
        calls it once, at `set_monitor`): take rank 0's run id, start time and UTC offset, as three integers
        (never a pickled object over the wire)."""
        if group is None:
            return
        import torch
        import torch.distributed as dist

        box = torch.tensor([int(self.run_id, 16), self._started, self._utc_offset], dtype=torch.int64)
        dist.broadcast(box, src=0, group=group)
        self.run_id, self._started, self._utc_offset = f"{int(box[0]):08x}", int(box[1]), int(box[2])
        self.run_dir = self._new_dir()

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
            # the node this rank ran on, for outputs that have no other record of it (CSV's layout.json)
            {**self.coords, "host": socket.gethostname()},
            self.unreduced_kind(config.monitor_mbs_grad),
            local_rank_from=self.env.local_rank_from,
            advertise_host=self.env.advertise_host,
        )
        try:
            return build_exporters(run, faults=self.faults)
        except Exception as exc:  # noqa: BLE001 - a sink that cannot open must not stop training
            self.faults.record("exporter open", exc, "output is off for this run, training continues")
            return []

    def renew(self, config: MonitorConfig, stamp: int | None = None) -> list:
        """A new run directory and sinks for it (new columns or sinks after a config change). The run id
        stays the job's; the time part is `stamp` (rank 0's clock, which `DynamicControl.poll` hands every
        rank with the config; this rank's clock when None), moved on by at least a second and written with
        the UTC offset shared at `set_monitor`, so the name is new, and the same on every rank (every rank
        renews at the same step), without a collective."""
        now = int(time.time()) if stamp is None else stamp
        self._started = max(now, self._started + 1)
        self.run_dir = self._new_dir()
        return self.open(config)
