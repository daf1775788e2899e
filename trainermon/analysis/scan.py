"""One streaming pass over a RUN: per-family cell grids, the first non-finite rows, rank copies.

Memory is bounded by the result (tensors x collected (step, micro_step) cells per family) plus one batch,
whatever the number of rows or ranks.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .grid import CellGrid
from .progress import Progress
from .rank_steps import FAMILY as STEPS_FAMILY
from .rank_steps import RankSteps, missing_steps_note
from .runs import Replaced, keep_latest, latest_first, multi_run, run_order
from .source import ALL_STATS, Batch, RunSource, family_order, open_run

#: Rows of a rank's first batch compared to find a possible whole-rank copy (then decided on all its rows).
FINGERPRINT_ROWS = 256
#: Non-finite rows kept per family (all at the earliest step with any).
MAX_NONFINITE_ROWS = 10_000


@dataclass
class RunSummary:
    """What a scan found. `grids[family]` holds the statistics; see `trends` for the views on it."""

    source: RunSource
    grids: dict[str, CellGrid]
    nonfinite_rows: dict[str, list[dict]]  # per family: the rows at its first non-finite step
    nonfinite_counts: dict[str, int]  # per family: rows with a NaN/Inf statistic or count
    copies: dict[tuple[str, int], int]  # (family, rank) -> the earlier rank it copies
    rows_read: int = 0  # rows folded into the grids (a copied rank's rows are read and hashed, not counted)
    files_read: int = 0
    seconds: float = 0.0
    steps: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    xrank_rows: Any = None  # the cross-rank summary rows (pandas), when asked for
    ranks: list[int] | None = None  # the ranks read when a subset was asked for (None: every rank)

    @property
    def families(self) -> list[str]:
        return sorted(self.grids, key=lambda f: (family_order(f), f))


def _fingerprint(batch: Batch, h: Any = None, rows: int | None = None) -> Any:
    """sha1 of a batch's names, steps and statistics (its first `rows` rows; all when None), folded into
    `h` when given: a rank's batches in turn give a fingerprint of its whole data."""
    k = len(batch) if rows is None else min(len(batch), rows)
    h = hashlib.sha1() if h is None else h
    h.update(f"{len(batch)}/{k}\x01".encode())
    h.update("\x00".join(f"{v}:{n}" for v, n in batch.tensors).encode())
    numel = () if batch.numel is None else (batch.numel[:k],)
    for arr in (batch.codes[:k], batch.step[:k], batch.micro[:k], *numel):
        h.update(np.ascontiguousarray(arr).tobytes())
    for stat in sorted(batch.stats):
        values, valid = batch.stats[stat]
        h.update(stat.encode())
        h.update(np.ascontiguousarray(values[:k]).tobytes())
        if valid is not None:
            h.update(np.ascontiguousarray(valid[:k]).tobytes())
    return h


class _NonFinite:
    """Rows with a NaN or Inf statistic (or a non-zero nans/infs count), kept at the earliest step."""

    def __init__(self) -> None:
        self.first_step: dict[str, int] = {}
        self.rows: dict[str, list[dict]] = {}
        self.counts: dict[str, int] = {}

    def add(self, batch: Batch) -> None:
        bad = np.zeros(len(batch), dtype=bool)
        empty = None if batch.numel is None else batch.numel == 0
        for stat, (values, valid) in batch.stats.items():
            if stat in ("nans", "infs"):
                hit = values > 0
            else:
                hit = ~np.isfinite(values)
                if empty is not None:
                    # no elements, no values: an empty tensor's mean/min/max are NaN by definition, and a
                    # NaN norm with no elements is the row msprobe writes for a None output
                    hit &= ~empty
            if valid is not None:
                hit &= valid
            bad |= hit
        if not bad.any():
            return
        fam = batch.family
        self.counts[fam] = self.counts.get(fam, 0) + int(bad.sum())
        idx = np.flatnonzero(bad)
        step = int(batch.step[idx].min())
        current = self.first_step.get(fam)
        if current is not None and step > current:
            return
        if current is None or step < current:
            self.first_step[fam] = step
            self.rows[fam] = []
        kept = self.rows[fam]
        for i in idx[batch.step[idx] == step]:
            if len(kept) >= MAX_NONFINITE_ROWS:
                break
            vpp, name = batch.tensors[int(batch.codes[i])]
            row: dict[str, Any] = {
                "family": fam,
                "rank": batch.rank,
                "vpp_stage": vpp,
                "name": name,
                "step": step,
                "micro_step": None if batch.micro[i] < 0 else int(batch.micro[i]),
            }
            for stat, (values, valid) in batch.stats.items():
                if valid is None or valid[i]:
                    row[stat] = float(values[i])
            kept.append(row)


def scan(
    run: str | os.PathLike | RunSource,
    families: Iterable[str] | None = None,
    stats: Iterable[str] | None = None,
    steps: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
    family_stats: dict[str, Iterable[str]] | None = None,
    batch_size: int = 65_536,
    progress: bool | None = None,
    label: str = "scan",
) -> RunSummary:
    """Read a RUN once and accumulate what the analyses need.

    families: families to read (default all). stats: statistics to keep (default all known ones);
    `family_stats` overrides them per family. steps: inclusive (first, last). ranks: ranks to read.
    progress: a stderr progress bar (None: only on a terminal).
    """
    source = run if isinstance(run, RunSource) else open_run(run)
    fams = source.families() if families is None else [f for f in families if f in source.families()]
    base_stats = list(ALL_STATS) if stats is None else [s for s in stats if s in ALL_STATS]
    per_family = {f: list(base_stats) for f in fams}
    for fam, st in (family_stats or {}).items():
        if fam in source.families():
            per_family[fam] = [s for s in st if s in ALL_STATS]
    files = source.select(list(per_family), ranks, steps)
    grids = {f: CellGrid(f, per_family[f]) for f in per_family}
    tracker = _NonFinite()
    rank_steps = RankSteps()
    summary = RunSummary(source, grids, tracker.rows, tracker.counts, {}, steps=steps)
    summary.notes.extend(source.notes)
    first_prints: dict[tuple[str, bytes], int] = {}  # (family, print of the first rows) -> rank
    whole_prints: dict[tuple[str, bytes], int] = {}  # (family, print of all the rows) -> rank
    groups: dict[tuple[str, int], list[Any]] = {}
    for f in files:
        groups.setdefault((f.family, f.rank), []).append(f)
    # A restart's runs of one rank: later runs first, their steps replace the earlier runs' (runs.py)
    order, replaced = run_order(source), Replaced()
    multi = {key for key, fs in groups.items() if order and multi_run(fs)}
    for key in multi:
        groups[key] = latest_first(groups[key], order)
    run_of = {f.path: f.run_id for key in multi for f in groups[key]}
    t0 = time.monotonic()
    bar = Progress(sum(f.size for f in files), label=label, enabled=progress)

    def done(f: Any) -> None:
        summary.files_read += 1
        bar.advance(f.size, note=f"{summary.rows_read:,} rows")

    def batches(key: tuple[str, int], on_done: Any = None) -> Iterator[Batch]:
        # numel: weights of mean/zeros, and empty tensors (whose mean/min/max are NaN by definition).
        it = source.iter_batches(
            stats=per_family[key[0]], with_numel=True, steps=steps, batch_size=batch_size,
            files=groups[key], on_file_done=on_done,
        )  # fmt: skip
        return keep_latest(it, run_of, order, replaced) if key in multi else it

    try:
        for key in groups:
            fam, rank = key
            it = batches(key, done)
            first = next(it, None)
            if first is None:
                continue
            head = (fam, _fingerprint(first, rows=FINGERPRINT_ROWS).digest())
            if head in first_prints:
                # Starts like an earlier rank: a copy only if ALL its rows are (a rank that differs later,
                # e.g. a NaN on it alone, must be read). One hashing pass; a rank that differs is read again.
                whole = _fingerprint(first)
                for batch in it:
                    _fingerprint(batch, whole)
                earlier = whole_prints.get((fam, whole.digest()))
                if earlier is not None:
                    summary.copies[key] = earlier
                    continue
                it = batches(key)
                first = next(it, None)
            else:
                first_prints[head] = rank
            whole = hashlib.sha1()
            for batch in itertools.chain([first] if first is not None else [], it):
                _fingerprint(batch, whole)
                summary.rows_read += len(batch)
                grids[fam].add(batch)
                if fam == STEPS_FAMILY:
                    rank_steps.add(rank, batch.step)
                tracker.add(batch)
            whole_prints.setdefault((fam, whole.digest()), rank)
    finally:
        bar.close()
    summary.seconds = time.monotonic() - t0
    redone = replaced.note()
    if redone:
        summary.notes.append(redone)
    if summary.copies:
        summary.notes.append(copies_note(summary.copies))
    gaps = missing_steps_note(rank_steps.by_rank())
    if gaps:
        summary.notes.append(gaps)
    return summary


def copies_note(copies: dict[tuple[str, int], int]) -> str:
    pairs = sorted(copies.items())
    shown = ", ".join(f"{fam} rank {r} = rank {o}" for (fam, r), o in pairs[:8])
    more = f" and {len(pairs) - 8} more" if len(pairs) > 8 else ""
    return (
        f"ranks whose rows copy an earlier rank's (replicated tensors written on every rank, as msprobe "
        f"does) were counted once: {shown}{more}"
    )
