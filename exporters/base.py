"""The exporter interface: a minimal sink that the background worker feeds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from trainermon.collect.records import StatBatch
from trainermon.config import MonitorConfig


@dataclass(frozen=True)
class RunInfo:
    """Where and for whom an exporter writes."""

    run_dir: str  # this rank's output directory, {MONITOR_OUTPUT_DIR}/{time}-rank{R}-{id}
    output_root: str  # MONITOR_OUTPUT_DIR
    rank: int
    world_size: int
    run_id: str
    config: MonitorConfig
    local_rank: int = 0  # LOCAL_RANK (the Prometheus port offset), read once with the environment
    #: This rank's place in the parallel layout, {"tp": [rank, size], "pp": ..., "dp": ..., "ep": ...}
    #: (empty when the adapter knows none): which piece a per-rank row (activations, pre-reduce
    #: gradients) comes from. Written with the run (CSV: `layout.json` in the run directory; Parquet: the
    #: run metadata).
    coords: dict = field(default_factory=dict)
    #: msprobe's tag kind of this run's grad_unreduced rows (`Adapter.msprobe_unreduced_kind`)
    grad_unreduced_kind: str = "pre_grad"
    local_rank_from: str = "LOCAL_RANK"  # the variable `local_rank` came from ("": none set, 0)
    advertise_host: str | None = None  # TRAINERMON_ADVERTISE_HOST: this node's address (per node)


class Exporter(ABC):
    """Called only from the background worker thread. A raised exception disables the exporter (the
    worker logs it once and counts it); other exporters and training continue."""

    def open(self, run: RunInfo) -> None:  # noqa: B027 - optional hook
        """Prepare output (create directories, open files, start servers)."""

    @abstractmethod
    def write(self, batch: StatBatch) -> None:
        """Write one step's statistics."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make everything written so far durable for readers (e.g. complete files)."""

    #: Seconds after which `tick` should run even when no step arrives (None: never needed).
    tick_s: float | None = None

    def tick(self) -> None:  # noqa: B027 - optional hook
        """Time passed (the worker calls it at least every `tick_s` seconds, with or without steps)."""

    def collection_stopped(self) -> None:  # noqa: B027 - optional hook
        """Collection stopped (dynamic_on switched off, collect_times reached), after the steps queued
        before: values that would read as current can go; the next step written means it is on again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources. Called once."""
