"""Anomaly records of steps a restart re-did: an output directory shared by restarts holds every run's
records, and the rows of a re-done step are read from the latest-started run (`runs.py`), so `analyze`
counts the records the same way and names the others."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .source import RunSource


def split_anomalies(
    source: RunSource, steps: tuple[int, int] | None = None, ranks: Iterable[int] | None = None
) -> tuple[list[dict], list[dict]]:
    """(kept, superseded): the run's anomaly records within `steps`, of `ranks` (None: every rank's).

    A restart into the same output directory re-does the steps after its checkpoint; the rows of such a
    step are read from the latest-started run that wrote it (`runs.py`), so a record of an earlier run
    at (rank, step) is superseded when a later-started run wrote that step on that rank (rows of it, or a
    record), and is returned apart: the records of a crash are kept for the report."""
    from trainermon.pipeline.anomaly_files import in_order, load_anomalies

    from .runs import run_order

    # The run's own records: an output directory shared by restarts holds every run's in one file.
    runs = {f.run_id for f in source.files} if source.run_id is None else {source.run_id}
    wanted = None if None in runs or not runs else runs
    records: list[dict] = []
    for directory in source.anomaly_dirs():
        records += load_anomalies(directory, steps, wanted)
    if ranks is not None:  # `--ranks` narrows the report: other ranks' records are not of it
        keep = {int(r) for r in ranks}
        records = [r for r in records if r.get("rank") is None or int(r["rank"]) in keep]
    # every run, also one that re-did a crashed run's step without an anomaly of its own
    ids = ({r.get("run_id") for r in records} | {f.run_id for f in source.files}) - {None}
    if len(ids) < 2 or not records:
        return in_order(records), []
    order = run_order(source)
    if not ids <= set(order):  # runs the rows do not order: by their first record, as `in_order` lists
        listed = in_order(records)
        order = {rid: i for i, rid in enumerate(dict.fromkeys(r.get("run_id") for r in listed))}
    # A record of an earlier run is superseded by a later run that wrote its step on its rank: a record
    # of that run there, or a row (read: a file's span is its step bucket, not the steps it holds).
    later: dict[tuple[int, Any], set[int]] = {}  # (rank, later run) -> record steps to look for
    mine = {(int(r["rank"]), r["run_id"], int(r["step"])) for r in records if _placed(r)}
    for rank, run, step in mine:
        for other in ids:
            if order.get(other, -1) > order.get(run, -1):
                later.setdefault((rank, other), set()).add(step)
    wrote = {key: _steps_written(source, *key, want) for key, want in later.items()}

    def superseded(rec: dict) -> bool:
        if not _placed(rec):
            return False  # a record that does not say its run or rank cannot be placed: kept
        rank, step, run = int(rec["rank"]), int(rec["step"]), rec["run_id"]
        return any(
            (rank, other, step) in mine or step in wrote.get((rank, other), ())
            for other in ids
            if order.get(other, -1) > order.get(run, -1)
        )

    flags = [superseded(r) for r in records]
    kept = [r for r, gone in zip(records, flags) if not gone]
    return in_order(kept), in_order([r for r, gone in zip(records, flags) if gone])


def _placed(rec: dict) -> bool:
    return rec.get("run_id") is not None and rec.get("rank") is not None


def _steps_written(source: RunSource, rank: int, run: Any, want: set[int]) -> set[int]:
    """The steps of `want` that `run` wrote rows of on `rank`: the step column of its files whose step
    bucket holds one of them, read until every step is found (remote files are not read here)."""
    found: set[int] = set()
    for f in [*source.files, *source.csv_steps]:
        if f.rank != rank or f.run_id != run or "://" in f.path or found >= want:
            continue
        if f.first_step is not None and f.last_step is not None:
            if not any(f.first_step <= s <= f.last_step for s in want - found):
                continue
        for batch in source.iter_batches(stats=(), files=[f], steps=(min(want), max(want))):
            found |= want & set(np.unique(batch.step).tolist())
    return found


def superseded_note(records: list[dict]) -> str | None:
    """The note on anomaly records left out because a restart re-did their steps."""
    if not records:
        return None
    by_run: dict[Any, list[int]] = {}
    for r in records:
        by_run.setdefault(r.get("run_id"), []).append(int(r["step"]))
    said = "; ".join(
        f"{len(s)} of run {run} (steps {min(s)}-{max(s)})"
        if min(s) != max(s)
        else f"{len(s)} of run {run} (step {s[0]})"
        for run, s in by_run.items()
    )
    return (
        f"{len(records)} anomaly records of steps a restart re-did are not counted (a later run wrote those "
        f"steps): {said}; findings.json lists them under anomalies.superseded (the records of a crash)"
    )
