"""The steps of a run that only its Parquet dataset holds, for the CSV converters (`convert`,
`csv2tensorboard_by_step`): a dynamic run that switched format mid-run has them, and a converter that
reads CSV files says so rather than leave a silent hole."""

from __future__ import annotations

import os
from collections import defaultdict

from trainermon.exporters.parquet_files import find_dataset


def parquet_left_out(
    directories: list[str],
    run_id: str,
    csv_steps: dict[tuple[str, int], set[int]],
    families: tuple[str, ...] | None = None,
    skip: str | None = None,
) -> str | None:
    """A line naming the (family, rank, steps) of run `run_id` that the Parquet dataset beside its CSV
    `directories` (their pointer, or `parquet/` in their parent) holds and `csv_steps` lacks (a dynamic
    run that switched format), None when there are none. Costs a few stat calls without a dataset; with
    one, a listing of its rank directories and one read of the step column of each part of the run whose
    file-name step range the CSV steps do not cover (as `trainermon analyze` judges them)."""
    from trainermon.analysis.mixed import _ranges
    from trainermon.analysis.source import _parquet_files

    roots: dict[str, str] = {}
    for directory in directories:
        for where in (directory, os.path.dirname(os.path.normpath(directory))):
            try:
                found = find_dataset(where)
            except (OSError, ValueError):  # an unreadable pointer: no dataset known there
                found = None
            real = os.path.realpath(found[0]) if found else None
            if found and real != (os.path.realpath(skip) if skip else None):
                roots.setdefault(real, found[0])
    ranks = {rank for _family, rank in csv_steps}
    lacking: dict[tuple[str, int], set[int]] = defaultdict(set)
    root = ""
    for root in roots.values():
        for f in _parquet_files(root, run_id):
            if f.run_id != run_id or f.rank not in ranks or (families and f.family not in families):
                continue
            have = csv_steps.get((f.family, f.rank), set())
            if f.first_step is not None and have.issuperset(range(f.first_step, f.last_step + 1)):
                continue  # every step of the part's name range is in the CSV files
            try:
                held = _part_steps(f.path)
            except Exception:  # noqa: BLE001 - unreadable part: its name range stands for its steps
                held = set(range(f.first_step, f.last_step + 1)) if f.first_step is not None else set()
            lacking[(f.family, f.rank)].update(held - have)
    said = [
        f"{family} rank {rank} steps {_ranges(list(s))}" for (family, rank), s in sorted(lacking.items()) if s
    ]
    if not said:
        return None
    return (
        f"run {run_id!r}: {len(said)} (family, rank) pairs have steps only in the Parquet dataset {root!r}, "
        f"left out: {'; '.join(said[:6])}{'; ...' if len(said) > 6 else ''} (`trainermon analyze` of the "
        f"monitor output reads both formats; trainermon.load({root!r}) reads the Parquet rows)"
    )


def _part_steps(path: str) -> set[int]:
    """The steps one Parquet part holds (its step column)."""
    import pyarrow.parquet as pq

    return set(pq.read_table(path, columns=["step"]).column("step").to_pylist())
