"""Open a RUN directory and stream its rows in bounded batches.

A RUN is any of (detected in this order):

- a trainermon Parquet dataset root (`family=.../rank=.../part-*.parquet`, written by the Parquet
  exporter or by `trainermon convert`);
- a MONITOR_OUTPUT_DIR holding such a dataset in `parquet/`;
- a rank's run directory with a `parquet.json` pointer (then only that run's rows);
- a directory with CSV output, trainermon's or msprobe's (the same layout:
  `{time}-rank{R}-{id}/{family}_{first}-{last}.csv`, at any depth).

`prefer="csv"` reads the CSV files of a directory that holds both; "auto" reads the Parquet dataset and the
CSV rows of its run at steps it lacks (a format switched mid-run: `mixed.py`). Rows come as `Batch`
objects of at most `batch_size` rows, one file at a time, in a deterministic order: by family, then by rank
(numeric), then by step range. Family, rank and step-range filters choose files before any is opened; the step
filter and the column projection are pushed into `pyarrow.dataset` (Parquet) and applied per block
(CSV). Nothing reads a whole dataset into memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainermon.collect.records import FAMILIES
from trainermon.exporters.csv_files import FILE, RANK_DIR, VPP_PREFIX
from trainermon.exporters.parquet_files import find_dataset, has_partitions
from trainermon.stats.table import COUNT_STATS, FLOAT_STATS

#: Statistics the analysis knows (float statistics, then counts), from the statistics table, then the
#: columns of single families drawn as heatmaps (`update`: ratio = ||dw|| / ||w||; `moe_load`: load_cv).
FAMILY_STATS = {"update": ("ratio",), "moe_load": ("load_cv",)}
ALL_STATS = FLOAT_STATS + COUNT_STATS + tuple(s for extra in FAMILY_STATS.values() for s in extra)


def family_order(family: str) -> int:
    """Position of a family in the order its hooks run within a step (unknown families last)."""
    return FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)


@dataclass(frozen=True)
class SourceFile:
    family: str
    rank: int
    path: str
    run_id: str | None
    first_step: int | None
    last_step: int | None
    size: int


@dataclass
class Batch:
    """Up to `batch_size` rows of one file: one family, one rank.

    tensors: the (vpp_stage, name) pairs of the batch, in order of first appearance; `codes[i]` is row
    i's index into `tensors`. micro_step is -1 where the family has none. `stats[s]` is (values, valid):
    float64 values (NaN where null) and a bool mask of non-null rows (None: all rows non-null).
    numel: float64, NaN where unknown (only when asked for).
    """

    family: str
    rank: int
    tensors: list[tuple[int, str]]
    codes: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    stats: dict[str, tuple[np.ndarray, np.ndarray | None]]
    numel: np.ndarray | None
    path: str

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class RunSource:
    """A detected RUN: what kind it is, its files, and a batch iterator over them."""

    path: str
    kind: str  # "parquet", "csv" or "msprobe-csv"
    root: str
    files: list[SourceFile]
    run_id: str | None = None
    notes: list[str] = field(default_factory=list)
    #: Parts (temporary) of this run's CSV rows at steps the dataset lacks (`mixed.py`); read with `files`.
    csv_steps: list[SourceFile] = field(default_factory=list)

    # ---- what is there ----------------------------------------------------------------------------
    def families(self) -> list[str]:
        return sorted({f.family for f in self.files}, key=lambda f: (family_order(f), f))

    def ranks(self, family: str | None = None) -> list[int]:
        return sorted({f.rank for f in self.files if family is None or f.family == family})

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def anomaly_dirs(self) -> list[str]:
        """`anomaly_detected/` directories of this run: in RUN, or in the output directory above it
        when RUN is a dataset root or a rank's run directory."""
        path = os.path.abspath(self.path)
        candidates = [path]
        inner = has_partitions(path) or RANK_DIR.search(os.path.basename(path)) is not None
        if inner:
            candidates.append(os.path.dirname(path))
        if self.kind == "parquet" and os.path.abspath(self.root) != os.path.join(path, "parquet"):
            candidates.append(os.path.dirname(os.path.abspath(self.root)))
        found: list[str] = []
        for base in candidates:
            path = os.path.join(base, "anomaly_detected")
            if os.path.isdir(path) and os.path.realpath(path) not in {os.path.realpath(p) for p in found}:
                found.append(path)
        return found

    def select(
        self,
        families: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        steps: tuple[int, int] | None = None,
    ) -> list[SourceFile]:
        fam = None if families is None else set(families)
        rk = None if ranks is None else {int(r) for r in ranks}
        out = []
        every = self.files if not self.csv_steps else sorted(self.files + self.csv_steps, key=_file_order)
        for f in every:
            if fam is not None and f.family not in fam:
                continue
            if rk is not None and f.rank not in rk:
                continue
            if steps is not None and f.first_step is not None and f.last_step is not None:
                if f.last_step < steps[0] or f.first_step > steps[1]:
                    continue
            out.append(f)
        return out

    # ---- reading ----------------------------------------------------------------------------------
    def iter_batches(
        self,
        families: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        steps: tuple[int, int] | None = None,
        stats: Iterable[str] = ("norm",),
        with_numel: bool = False,
        batch_size: int = 65_536,
        files: list[SourceFile] | None = None,
        on_file_done: Any = None,
    ) -> Iterator[Batch]:
        """Batches of the selected files, in file order. `on_file_done(file)` runs after each file."""
        from .readers import csv_batches, parquet_batches

        wanted = [s for s in stats if s in ALL_STATS]
        chosen = files if files is not None else self.select(families, ranks, steps)
        for f in chosen:
            if self.kind == "parquet":
                yield from parquet_batches(f, wanted, with_numel, steps, self.run_id, batch_size)
            else:
                yield from csv_batches(f, wanted, with_numel, steps, batch_size)
            if on_file_done is not None:
                on_file_done(f)


# ---- detection --------------------------------------------------------------------------------------
def open_run(path: str | os.PathLike, prefer: str = "auto", run_id: str | None = None) -> RunSource:
    """Detect what `path` holds (see the module doc) and list its files.

    prefer: "auto" (Parquet when there is a dataset), "parquet" or "csv".
    run_id: keep only the rows of this run id (Parquet part files carry it in their name; CSV rank
        directories in theirs).
    Raises FileNotFoundError when `path` is not a directory or holds no monitor output.
    """
    path = os.fspath(path)
    if prefer not in ("auto", "parquet", "csv"):
        raise ValueError(f"prefer: got {prefer!r}; allowed: 'auto', 'parquet', 'csv'")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory")
    if prefer in ("auto", "parquet"):
        root, pointed = find_dataset(path) or (None, None)
        if root is not None:
            wanted_run = run_id if run_id is not None else pointed
            files = _parquet_files(root, wanted_run)
            if files:
                source = RunSource(path, "parquet", root, files, wanted_run)
                _note_mixed_runs(source)
                _note_missing_ranks(source)
                if prefer == "auto":  # CSV steps of the run the dataset lacks (mixed.py)
                    from .mixed import add_csv_steps

                    add_csv_steps(source, _csv_files(path, run_id))
                return source
        if prefer == "parquet":
            _missing_run_id(path, run_id, root, csv=False)
            raise FileNotFoundError(f"no trainermon Parquet dataset at {path!r}")
    files = _csv_files(path, run_id)
    empty = [f for f in files if f.size == 0]  # created, then the writer was killed (older versions)
    files = [f for f in files if f.size > 0]
    if not files:
        _missing_run_id(path, run_id, None if prefer == "csv" else root, csv=True)
        if prefer == "csv":  # asked for CSV: a Parquet dataset there is not what was asked for
            there = (
                " (it holds a Parquet dataset: leave out --format csv to read it)"
                if find_dataset(path)
                else ""
            )
            raise FileNotFoundError(
                f"no CSV files named {{family}}_{{first}}-{{last}}.csv under {path!r} (--format csv){there}"
            )
        raise FileNotFoundError(
            f"no monitor output under {path!r}: expected a Parquet dataset (family=*/rank=*/part-*.parquet) "
            "or CSV files named {family}_{first}-{last}.csv"
        )
    first_per_family = {f.family: f.path for f in reversed(files)}
    kind = "msprobe-csv" if any(_looks_msprobe(p) for p in first_per_family.values()) else "csv"
    source = RunSource(path, kind, path, files, run_id)
    _note_mixed_runs(source)
    _note_missing_ranks(source)
    if empty:
        names = [os.path.basename(f.path) for f in empty[:3]]
        source.notes.append(
            f"{len(empty)} empty CSV files (a writer stopped as it made them) are skipped: {names}"
        )
    return source


def _missing_run_id(path: str, run_id: str | None, root: str | None, csv: bool) -> None:
    """Raise when `run_id` selected nothing but the directory holds rows of other run ids: name the run
    id and list those that are there (saying "no monitor output" would send the user looking for a
    wrong path)."""
    if run_id is None:
        return
    ids = {f.run_id for f in _parquet_files(root, None)} if root is not None else set()
    if csv:
        ids |= {f.run_id for f in _csv_files(path, None)}
    ids.discard(None)
    if ids:
        raise FileNotFoundError(f"run id {run_id!r} is not in {path!r} (the run ids there: {sorted(ids)})")


def _parse_part(name: str) -> tuple[int, int, str] | None:
    if not name.startswith("part-") or not name.endswith(".parquet"):
        return None
    bits = name[len("part-") : -len(".parquet")].split("-")
    if len(bits) < 4 or not bits[0].isdigit() or not bits[1].isdigit():
        return None
    return int(bits[0]), int(bits[1]), "-".join(bits[2:-1])


def _parquet_files(root: str, run_id: str | None) -> list[SourceFile]:
    out: list[SourceFile] = []
    try:
        fdirs = [e for e in os.scandir(root) if e.is_dir() and e.name.startswith("family=")]
    except OSError:
        return out
    for fdir in fdirs:
        family = fdir.name[len("family=") :]
        for rdir in os.scandir(fdir.path):
            value = rdir.name[len("rank=") :]
            if not (rdir.is_dir() and rdir.name.startswith("rank=") and value.lstrip("-").isdigit()):
                continue
            for entry in os.scandir(rdir.path):
                if entry.name.startswith((".", "_")) or not entry.name.endswith(".parquet"):
                    continue  # temporary (incomplete) parts and side files
                parsed = _parse_part(entry.name)
                first, last, rid = parsed if parsed is not None else (None, None, None)
                if run_id is not None and rid is not None and rid != run_id:
                    continue
                out.append(SourceFile(family, int(value), entry.path, rid, first, last, entry.stat().st_size))
    out.sort(key=_file_order)
    return out


def _file_order(f: SourceFile) -> tuple:
    return (family_order(f.family), f.family, f.rank, os.path.basename(f.path))


def _csv_files(path: str, run_id: str | None) -> list[SourceFile]:
    out: list[SourceFile] = []
    for directory, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("family=", "."))]  # never descend into a dataset
        base = os.path.basename(os.path.normpath(directory))
        match = RANK_DIR.search(base)
        rank = int(match.group("rank")) if match else 0
        rid = (match.group("id") if match else None) or base
        if run_id is not None and rid != run_id:
            continue
        for name in names:
            m = FILE.match(name)
            if m is None:
                continue
            full = os.path.join(directory, name)
            out.append(
                SourceFile(
                    m.group("family"),
                    rank,
                    full,
                    rid,
                    int(m.group("first")),
                    int(m.group("last")),
                    os.path.getsize(full),
                )
            )
    out.sort(
        key=lambda f: (
            family_order(f.family),
            f.family,
            f.rank,
            os.path.dirname(f.path),
            f.first_step,
            os.path.basename(f.path),
        )
    )
    return out


def _read_header(path: str) -> list[str]:
    with open(path, encoding="utf-8", newline="") as fh:
        line = fh.readline()
    return [c.strip() for c in line.strip().split(",")]


def _looks_msprobe(path: str) -> bool:
    """msprobe's older files: no vpp_stage column, or `{vpp}:{name}` names. (Newer msprobe files have
    trainermon's exact layout, and read the same way.)"""
    header = _read_header(path)
    if "vpp_stage" not in header:
        return True
    with open(path, encoding="utf-8", newline="") as fh:
        fh.readline()
        first = fh.readline()
    name_at = header.index("name") if "name" in header else 1
    cells = first.split(",")
    return len(cells) > name_at and VPP_PREFIX.match(cells[name_at]) is not None


def _note_missing_ranks(source: RunSource) -> None:
    from .layout import missing_ranks_note

    note = missing_ranks_note(source)
    if note is not None:
        source.notes.append(note)


def _note_mixed_runs(source: RunSource) -> None:
    runs: dict[tuple[str, int], set] = {}
    for f in source.files:
        runs.setdefault((f.family, f.rank), set()).add(f.run_id)
    mixed = sorted({rank for (_fam, rank), ids in runs.items() if len(ids) > 1})
    if mixed:
        ids = sorted({i for f in source.files if f.rank in mixed for i in [f.run_id] if i is not None})
        source.notes.append(
            f"ranks {mixed[:10]} hold rows of more than one run id (restarts or several jobs in one "
            "directory); a step several runs wrote is read from the latest-started one. Pass --run-id "
            f"(run_id= in Python) to keep one of {ids[:10]}."
        )
