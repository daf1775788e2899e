"""Parquet exporter: one tidy, Hive-partitioned dataset for every family and every rank.

Layout (the dataset root defaults to `{MONITOR_OUTPUT_DIR}/parquet`, shared by all ranks of a job):

    {root}/family={family}/rank={rank}/part-{first_step:012d}-{last_step:012d}-{run_id}-{seq:05d}.parquet

Every rank writes only under its own `rank=` directory, and every file name carries the rank's run id,
so ranks of one job (and restarts of one rank) never write the same file. `family` and `rank` are
partition columns: they live in the directory names, not in the files (the Hive convention, so that
pyarrow, DuckDB and Spark read the root as one dataset). The step range in the file name lets a reader
skip files without opening them (see `trainermon.load`).

A part file is written whole under a hidden temporary name (`.part-....parquet.tmp`, which dataset
readers ignore), fsynced, then renamed, so a reader (or a job killed mid-write) never sees a partial
file. Rows are buffered and a part holds them in one large row group; parts are completed every
`steps_per_part` collected steps, at `rows_per_part` buffered rows of a family, `seconds_per_part`
after the first buffered row, and at every `flush()` (so a flushed step is never lost).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import numpy as np

from trainermon.collect.records import StatBatch

from .base import Exporter, RunInfo

# The dataset's files (schema, names, buffers, atomic writes) live in parquet_files; re-exported here for
# code that imported them from this module.
from .parquet_files import (  # noqa: F401
    COLUMNS,
    COUNT_STATS,
    DATASET_MARKER,
    EXTRA_FAMILIES,
    EXTRA_FLOATS,
    EXTRA_INTS,
    FLOAT_STATS,
    POINTER_FILE,
    SCHEMA_VERSION,
    STATS,
    ColumnBuffer,
    _pa,
    config_json,
    default_root,
    file_schema,
    parse_part_name,
    part_name,
    partition_schema,
    pointer,
    warm_up,
    write_dataset_marker,
    write_part,
)

logger = logging.getLogger("trainermon")


class ParquetExporter(Exporter):
    def open(self, run: RunInfo) -> None:
        _pa()  # fail at open (one clear error) when pyarrow is missing
        section = run.config.parquet
        # pyarrow's lazy imports (pandas) on this thread now, not in the worker's first part (`warm_up`)
        warm_up(section.compression, section.compression_level)
        self.run = run
        self.root = os.path.realpath(default_root(run.output_root, section.dir))
        self.steps_per_part = section.steps_per_part
        self.rows_per_part = section.rows_per_part
        self.seconds_per_part = section.seconds_per_part
        self.compression = section.compression
        self.compression_level = section.compression_level
        self.ops = set(run.config.ops)
        self.buffers: dict[str, ColumnBuffer] = {}
        self.seq: dict[str, int] = {}
        self.steps_buffered = 0
        self.buffer_started: float | None = None
        os.makedirs(self.root, exist_ok=True)
        write_dataset_marker(self.root)
        self.metadata = {
            "trainermon.config": config_json(run.config),
            "trainermon.run": json.dumps(
                {
                    "run_id": run.run_id,
                    "rank": run.rank,
                    "world_size": run.world_size,
                    "run_dir": run.run_dir,
                    "coords": run.coords,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                    "started": time.time(),
                },
                sort_keys=True,
            ),
        }
        os.makedirs(run.run_dir, exist_ok=True)
        with open(os.path.join(run.run_dir, POINTER_FILE), "w", encoding="utf-8") as fh:
            json.dump(pointer(run.run_dir, self.root, run.rank, run.run_id), fh)

    def write(self, batch: StatBatch) -> None:
        if not batch.rows:
            return
        by_family: dict[str, list[int]] = {}
        for i, row in enumerate(batch.rows):
            by_family.setdefault(row.family, []).append(i)
        for family, indices in by_family.items():
            idx = np.asarray(indices, dtype=np.int64)
            rows = [batch.rows[i] for i in indices]
            n = len(rows)
            micro = np.array([-1 if r.micro_step is None else r.micro_step for r in rows], dtype=np.int64)
            steps = np.full(n, batch.step, dtype=np.int64)
            columns: dict[str, Any] = {
                "run_id": [self.run.run_id] * n,
                "vpp_stage": [r.vpp_stage for r in rows],
                "name": [r.name for r in rows],
                "step": steps,
                "micro_step": micro,
                "numel": [r.numel for r in rows],
                "shape": [list(r.shape) for r in rows],
                "dtype": [str(r.dtype) for r in rows],
                "shard": [r.shard or None for r in rows],
                "skipped": [batch.scalars.update_skipped] * n,
                "own_skip": [_own_skip(batch.scalars)] * n,
                "calls": [r.calls if family == "comm" else None for r in rows],
                "bytes": [r.nbytes if family == "comm" else None for r in rows],
            }
            for stat in STATS:
                if stat in self.ops and stat in batch.values:
                    columns[stat] = np.asarray(batch.values[stat], dtype=np.float64)[idx]
                else:
                    columns[stat] = None  # not collected: null, never a made-up number
            for extra, families in EXTRA_FAMILIES.items():
                got = batch.values.get(extra)
                mine = got is not None and family in families
                if not mine:
                    columns[extra] = None
                elif extra in EXTRA_FLOATS or extra in EXTRA_INTS:
                    columns[extra] = np.asarray(got, dtype=np.float64)[idx]
                else:
                    columns[extra] = [got[i] for i in indices]
            buffer = self.buffers.setdefault(family, ColumnBuffer())
            buffer.extend(columns, steps)
        if batch.xrank is not None and batch.xrank.rows:
            self._buffer_xrank(batch)
        self.steps_buffered += 1
        if self.buffer_started is None:
            self.buffer_started = time.monotonic()
        if self.steps_buffered >= self.steps_per_part or (
            self.seconds_per_part is not None
            and time.monotonic() - self.buffer_started >= float(self.seconds_per_part)
        ):
            self._roll(list(self.buffers))
        else:
            self._roll([f for f, b in self.buffers.items() if b.rows >= self.rows_per_part])

    def _buffer_xrank(self, batch: StatBatch) -> None:
        """Cross-rank summaries as rows of family `xrank` (one per family, name, micro_step, statistic)."""
        columns = batch.xrank.columns()
        n = len(batch.xrank.rows)
        steps = np.full(n, batch.step, dtype=np.int64)
        columns.update(run_id=[self.run.run_id] * n, step=steps)
        self.buffers.setdefault("xrank", ColumnBuffer()).extend(columns, steps)

    def _roll(self, families: list[str]) -> None:
        for family in families:
            buffer = self.buffers.pop(family, None)
            if buffer is None or buffer.rows == 0:
                continue
            seq = self.seq.get(family, 0)
            self.seq[family] = seq + 1
            write_part(  # its path is not kept: a list of every part grew for the life of the run
                self.root,
                family,
                self.run.rank,
                self.run.run_id,
                seq,
                buffer,
                self.metadata,
                self.compression,
                self.compression_level,
            )
        if not self.buffers:
            self.steps_buffered = 0
            self.buffer_started = None

    def flush(self) -> None:
        self._roll(list(self.buffers))

    @property
    def tick_s(self) -> float | None:  # type: ignore[override]
        return None if self.seconds_per_part is None else float(self.seconds_per_part)

    def tick(self) -> None:
        """`seconds_per_part` bounds what a crash can lose also when no further step comes (a job that
        collects rarely, a long evaluation): buffers that old are written without waiting for a step."""
        started = self.buffer_started
        if started is not None and self.tick_s is not None and time.monotonic() - started >= self.tick_s:
            self._roll(list(self.buffers))

    def close(self) -> None:
        self.flush()


def _own_skip(scalars: Any) -> bool | None:
    """The `own_skip` column: null where the update's fate is not known."""
    if scalars.update_skipped is None:
        return None
    return bool(scalars.update_skipped) and scalars.own_skip
