"""Several runs of one rank in one RUN (a restart into the same output directory): which run's rows count.

A job that saved a checkpoint before step 4, ran on to step 5 and crashed, then resumed from the
checkpoint, has steps 4-5 written twice by each rank, once per run. Those rows are not shards of one
tensor (grid.py adds a cell's rows as disjoint pieces): the restart re-did the step, so for each
(family, rank, step) only the rows of the latest-started run that wrote it are read; the earlier run's
rows of that step are left out (whichever of its tensors the later run did not write too: they come from
the abandoned trajectory). Steps only one run wrote are read as they are.

Runs are ordered by start: a Parquet part's footer (`trainermon.run` "started", one footer per run id);
a CSV rank directory's `{time}` name (second resolution); then the earliest file time of the run (a run
that started after another crashed writes every file after the crashed run's last one). The pyarrow scan
reads a rank's later runs first and drops rows of steps a later run holds (`Keeper`); the SQL engines keep
the rows whose run is the latest at their (family, rank, step) (`sqlplan.latest_runs`). Sources with one
run per (family, rank) pay nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from .source import Batch, RunSource, SourceFile

_STAMP = re.compile(r"^(?P<mon>[A-Z][a-z]{2})(?P<day>\d{2})_(?P<h>\d{2})-(?P<m>\d{2})-(?P<s>\d{2})-rank")
#: The words of the note on re-done steps (`compare` passes that note on from its scans).
REDONE = "wrote some steps in more than one run"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def run_order(source: RunSource) -> dict[Any, int]:
    """Run id -> position by start (0: the earliest), for sources where some (family, rank) holds rows
    of several run ids; {} otherwise. Costs one listing pass over the files, plus (only then) one stat per
    file and one Parquet footer per run id."""
    ids: dict[tuple[str, int], set] = {}
    for f in source.files:
        ids.setdefault((f.family, f.rank), set()).add(f.run_id)
    if all(len(v) < 2 for v in ids.values()):
        return {}
    keys: dict[Any, tuple] = {}
    for f in source.files:
        if f.run_id is None or "://" in f.path:
            continue
        try:
            mtime = os.stat(f.path).st_mtime
        except OSError:
            continue
        key = keys.get(f.run_id)
        if key is None:
            key = keys[f.run_id] = (_started(f, source.kind), mtime)
        elif mtime < key[1]:
            keys[f.run_id] = (key[0], mtime)
    ordered = sorted(keys, key=lambda rid: (*keys[rid], str(rid)))
    return {rid: i for i, rid in enumerate(ordered)}


def _started(f: SourceFile, kind: str) -> tuple:
    """The run's start as a sortable tuple, () when the file does not say."""
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq

            meta = pq.read_metadata(f.path).metadata or {}
            return (float(json.loads(meta[b"trainermon.run"])["started"]),)
        except (OSError, KeyError, ValueError, TypeError, ImportError):
            return ()
    m = _STAMP.match(os.path.basename(os.path.dirname(f.path)))
    if m is None or m.group("mon") not in _MONTHS:
        return ()
    # no year in the name: a run that crosses New Year's Eve is ordered by file times only when tied
    return (_MONTHS.index(m.group("mon")), *(int(m.group(k)) for k in ("day", "h", "m", "s")))


def multi_run(files: list[SourceFile]) -> bool:
    return len({f.run_id for f in files}) > 1


def latest_first(files: list[SourceFile], order: dict[Any, int]) -> list[SourceFile]:
    """`files` with later runs first (stable within a run): the reading order of a multi-run rank."""
    return sorted(files, key=lambda f: -order.get(f.run_id, -1))


def reading_order(files: list[SourceFile], order: dict[Any, int]) -> list[SourceFile]:
    """`files` (grouped by family and rank), each multi-run group's later runs first."""
    if not order:
        return files
    groups: dict[tuple[str, int], list[SourceFile]] = {}
    for f in files:
        groups.setdefault((f.family, f.rank), []).append(f)
    return [f for fs in groups.values() for f in (latest_first(fs, order) if multi_run(fs) else fs)]


class Replaced:
    """(family, rank, step) -> (earliest run left out, run kept): what the note reports."""

    def __init__(self) -> None:
        self.steps: dict[tuple[str, int, int], tuple[Any, Any]] = {}

    def add(self, family: str, rank: int, step: int, dropped: Any, kept: Any, order: dict) -> None:
        key = (family, rank, step)
        old = self.steps.get(key)
        if old is None or order.get(dropped, -1) < order.get(old[0], -1):
            self.steps[key] = (dropped, kept)

    def note(self) -> str | None:
        if not self.steps:
            return None
        pairs: dict[tuple, set[int]] = {}
        for (_fam, _rank, step), runs in self.steps.items():
            pairs.setdefault(runs, set()).add(step)
        ranks = sorted({rank for _f, rank, _s in self.steps})
        said = "; ".join(
            f"{len(steps)} steps ({_span(sorted(steps))}) from run {kept} over run {dropped}"
            for (dropped, kept), steps in sorted(pairs.items(), key=lambda p: min(p[1]))
        )
        return (
            f"ranks {ranks[:10]} {REDONE} (a restart re-did them): the rows of "
            f"the latest-started run are used, the earlier run's rows of those steps are left out: {said}. "
            "Pass --run-id (run_id= in Python) to read one run alone."
        )


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def take(batch: Batch, keep: np.ndarray) -> Batch:
    """The rows of `batch` where `keep` is True (the tensor list is kept as it is)."""
    stats = {s: (v[keep], None if m is None else m[keep]) for s, (v, m) in batch.stats.items()}
    numel = None if batch.numel is None else batch.numel[keep]
    return Batch(
        batch.family, batch.rank, batch.tensors, batch.codes[keep], batch.step[keep], batch.micro[keep],
        stats, numel, batch.path,
    )  # fmt: skip


def keep_latest(
    batches: Iterator[Batch], run_of: dict[str, Any], order: dict[Any, int], replaced: Replaced
) -> Iterator[Batch]:
    """The rows of `batches` (a rank's, later runs first) whose step no later run wrote. Costs a set
    lookup per distinct step of a batch and one mask over its rows."""
    later: dict[int, Any] = {}  # step -> the run kept for it, from runs already read
    own: set[int] = set()
    current = None
    for batch in batches:
        run = run_of.get(batch.path)
        if run != current:
            for s in own:
                later.setdefault(s, current)  # a step an even later run holds stays that run's
            own, current = set(), run
        steps = np.unique(batch.step)
        own.update(steps.tolist())
        gone = [s for s in steps.tolist() if s in later]
        if not gone:
            yield batch
            continue
        for s in gone:
            replaced.add(batch.family, batch.rank, s, run, later[s], order)
        kept = take(batch, ~np.isin(batch.step, np.asarray(gone, dtype=batch.step.dtype)))
        if len(kept):
            yield kept
