"""CSV steps beside a Parquet dataset, read with it (`open_run` in auto mode).

One run can hold steps in both formats: a dynamic reload that switches `format` (csv -> parquet -> csv)
writes each phase's steps in that phase's format only, and a job stopped before a Parquet part was full
(`format: [csv, parquet]`) has its last steps in CSV only. The rows of CSV files of a (family, rank, run
id) that the dataset also holds, at steps no Parquet part of it covers, are converted once into a private
temporary Parquet dataset (removed when the RunSource is freed, or at exit), so every reader (pyarrow
batches, DuckDB, Spark, the layer tables) reads one format and the union is read by (family, rank, step).
CSV files of (family, rank) pairs that the dataset lacks (a format switched between restarts) are named
in a note, not read."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections import defaultdict

import numpy as np

from trainermon.exporters.parquet_files import ColumnBuffer, write_part

from .source import RunSource, SourceFile


def add_csv_steps(source: RunSource, csv_files: list[SourceFile]) -> None:
    """Add to `source` (a Parquet run) the CSV rows of its (family, rank, run id) groups at steps its parts
    do not cover, and a note naming those steps. Costs nothing where the CSV file names show every step
    covered (one name parse per file); otherwise one read of each uncovered CSV file and one Parquet
    part per file written to a temporary directory."""
    have = {(f.family, f.rank) for f in source.files}
    left = sorted({(f.family, f.rank) for f in csv_files} - have)
    if left:
        ranks = sorted({rank for _family, rank in left})
        source.notes.append(
            f"CSV files hold {len(left)} (family, rank) pairs that the Parquet dataset lacks (ranks "
            f"{ranks[:10]}): they are not read; pass --format csv to read the CSV files instead"
        )
    spans: dict[tuple, list[tuple[int, int] | None]] = defaultdict(list)
    for f in source.files:
        ok = f.first_step is not None and f.last_step is not None
        spans[(f.family, f.rank, f.run_id)].append((f.first_step, f.last_step) if ok else None)
    # another job's CSV in a reused output directory (another run id) is not this run's
    todo = [
        f
        for f in csv_files
        if f.size > 0
        and f.run_id is not None
        and (f.family, f.rank, f.run_id) in spans
        and f.first_step is not None
    ]
    added, steps, bad, root = [], set(), [], ""
    for f in todo:
        covered = spans[(f.family, f.rank, f.run_id)]
        if None in covered:  # a part of unknown steps: its rows cannot be told apart, so none are added
            continue
        if any(lo <= f.first_step and f.last_step <= hi for lo, hi in covered):  # type: ignore[misc]
            continue  # the file's step bucket lies within one part: all its steps are there
        try:
            root = root or _new_root(source)
            part = _convert(f, covered, root, len(added))  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:  # a cut or hand-edited line: said, the rest still read
            bad.append(f"{os.path.basename(f.path)} ({exc})")
            continue
        if part is not None:
            added.append(part[0])
            steps.update(part[1])
    if bad:
        source.notes.append(f"CSV files beside the Parquet dataset could not be read: {bad[:3]}")
    if not added:
        return
    pq_steps = [s for f in source.files for s in (f.first_step, f.last_step) if s is not None]
    source.csv_steps.extend(added)
    first, last = min(pq_steps), max(pq_steps)
    said = [
        f"{label}steps {_ranges(chosen)}"
        for label, chosen in (
            ("earlier ", [s for s in steps if s < first]),
            ("", [s for s in steps if first <= s <= last]),
            ("later ", [s for s in steps if s > last]),
        )
        if chosen
    ]
    source.notes.append(
        f"CSV files beside the Parquet dataset (steps {first}-{last}) hold {', '.join(said)} that it lacks "
        "(a format switched mid-run, or steps written before a Parquet part was): read from the CSV files "
        "(--format csv reads the CSV files alone)"
    )


def _convert(
    f: SourceFile, covered: list[tuple[int, int]], root: str, seq: int
) -> tuple[SourceFile, set[int]] | None:
    """The rows of CSV file `f` at steps outside `covered` as one Parquet part (None: no such rows)."""
    from trainermon.convert import _columns, _read_csv

    rows = [r for r in _read_csv(f.path) if not any(lo <= int(r["step"]) <= hi for lo, hi in covered)]
    if not rows:
        return None
    rows.sort(key=lambda r: int(r["step"]))  # stable: a step's rows keep their order
    buffer = ColumnBuffer()
    step = np.array([int(r["step"]) for r in rows], dtype=np.int64)
    assert f.run_id is not None
    buffer.extend(_columns(rows, f.run_id), step)
    path = write_part(root, f.family, f.rank, f.run_id, seq, buffer, {"trainermon.converted_from": f.path})
    first, last = int(step.min()), int(step.max())
    part = SourceFile(f.family, f.rank, path, f.run_id, first, last, os.path.getsize(path))
    return part, set(step.tolist())


def _new_root(source: RunSource) -> str:
    """A new temporary dataset directory (one per `open_run` that needs one), removed when `source` is
    freed (the analysis that opened it is done: a long session opening many runs keeps none) or at exit."""
    root = tempfile.mkdtemp(prefix="trainermon-csv-steps-")
    weakref.finalize(source, shutil.rmtree, root, True)
    return root


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 6, 7] -> "0-2, 6-7"."""
    out: list[str] = []
    ordered = sorted(set(steps))
    start = prev = ordered[0]
    for s in [*ordered[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if s is not None:
            start = prev = s
    return ", ".join(out)
