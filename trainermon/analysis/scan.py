"""One streaming pass over a RUN: per-family cell grids, the first non-finite rows, rank copies.

Memory is bounded by the result (tensors x collected (step, micro_step) cells per family) plus one batch,
whatever the number of rows or ranks.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .grid import CellGrid
from .progress import Progress
from .rank_steps import FAMILY as STEPS_FAMILY
from .rank_steps import RankSteps, missing_steps_note
from .source import ALL_STATS, Batch, RunSource, family_order, open_run

#: Rows of a rank's first batch compared to recognise a whole-rank copy.
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
    rows_read: int = 0  # rows folded into the grids (a copied rank's first batch is read, not counted)
    files_read: int = 0
    seconds: float = 0.0
    steps: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    xrank_rows: Any = None  # the cross-rank summary rows (pandas), when asked for
    ranks: list[int] | None = None  # the ranks read when a subset was asked for (None: every rank)

    @property
    def families(self) -> list[str]:
        return sorted(self.grids, key=lambda f: (family_order(f), f))


def _fingerprint(batch: Batch) -> bytes:
    k = min(len(batch), FINGERPRINT_ROWS)
    h = hashlib.sha1()
    codes = batch.codes[:k]
    h.update("\x00".join(f"{v}:{n}" for v, n in batch.tensors).encode())
    for arr in (codes, batch.step[:k], batch.micro[:k]):
        h.update(np.ascontiguousarray(arr).tobytes())
    for stat in sorted(batch.stats):
        values, valid = batch.stats[stat]
        h.update(stat.encode())
        h.update(np.ascontiguousarray(values[:k]).tobytes())
        if valid is not None:
            h.update(np.ascontiguousarray(valid[:k]).tobytes())
    return h.digest()


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
    seen_prints: dict[tuple[str, bytes], int] = {}
    started: set[tuple[str, int]] = set()
    skip: set[tuple[str, int]] = set()
    t0 = time.monotonic()
    bar = Progress(sum(f.size for f in files), label=label, enabled=progress)

    def done(f: Any, read: bool = True) -> None:
        summary.files_read += int(read)
        bar.advance(f.size, note=f"{summary.rows_read:,} rows")

    try:
        for f in files:
            key = (f.family, f.rank)
            if key in skip:  # a rank that copies an earlier one: not opened
                done(f, read=False)
                continue
            need = per_family[f.family]
            # numel: weights of mean/zeros, and empty tensors (whose mean/min/max are NaN by definition).
            for batch in source.iter_batches(
                stats=need, with_numel=True, steps=steps, batch_size=batch_size, files=[f]
            ):
                if key not in started:
                    started.add(key)
                    fp = (f.family, _fingerprint(batch))
                    if fp in seen_prints:
                        summary.copies[key] = seen_prints[fp]
                        skip.add(key)
                        break
                    seen_prints[fp] = f.rank
                summary.rows_read += len(batch)
                grids[f.family].add(batch)
                if f.family == STEPS_FAMILY:
                    rank_steps.add(f.rank, batch.step)
                tracker.add(batch)
            done(f)
    finally:
        bar.close()
    summary.seconds = time.monotonic() - t0
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
