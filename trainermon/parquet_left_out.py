"""The steps of a run that only its Parquet dataset holds, for the CSV converters (`convert`,
`csv2tensorboard_by_step`): a dynamic run that switched format mid-run has them, and a converter that
reads CSV files says so rather than leave a silent hole."""

from __future__ import annotations

import os
from collections import defaultdict

from trainermon.exporters.csv_files import RANK_DIR
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

    skipped = os.path.realpath(skip) if skip else None
    roots: dict[str, str] = {}
    for where in _places(directories, run_id):
        try:
            found = find_dataset(where)
        except Exception:  # noqa: BLE001 - a damaged pointer: no dataset known there (the note is a courtesy)
            found = None
        if found and os.path.realpath(found[0]) != skipped:
            roots.setdefault(os.path.realpath(found[0]), found[0])
    ranks = sorted({rank for _family, rank in csv_steps})
    lacking: dict[tuple[str, int], set[int]] = defaultdict(set)
    named = ""
    for root in roots.values():
        for family, rank, path, first, last in _run_parts(root, run_id, ranks, families):
            have = csv_steps.get((family, rank), set())
            if have.issuperset(range(first, last + 1)):
                continue  # every step of the part's name range is in the CSV files
            try:
                held = _part_steps(path)
            except Exception:  # noqa: BLE001 - unreadable part: its name range stands for its steps
                held = set(range(first, last + 1))
            if held - have:
                lacking[(family, rank)].update(held - have)
                named = root
    root = named
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


def _places(directories: list[str], run_id: str) -> list[str]:
    """Where a pointer to the run's dataset may be: the CSV directories, their parents (`parquet/`), and
    their sibling directories of the same run id (a Parquet-only phase's directory holds the pointer)."""
    places = list(directories)
    for parent in sorted({os.path.dirname(os.path.normpath(d)) for d in directories}):
        places.append(parent)
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            continue
        for name in names:
            match = RANK_DIR.search(name)
            if match is not None and match.group("id") == run_id:
                places.append(os.path.join(parent, name))
    return list(dict.fromkeys(places))


def _run_parts(root: str, run_id: str, ranks: list[int], families: tuple[str, ...] | None) -> list[tuple]:
    """(family, rank, path, first, last) of the run's parts under `root`, for `ranks` only (a listing of
    those rank directories, not the whole dataset's: converting one rank at a time stays linear)."""
    from trainermon.analysis.source import _parse_part

    out = []
    try:
        family_dirs = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name.startswith("family="))
    except OSError:
        return out
    for family_dir in family_dirs:
        family = family_dir[len("family=") :]
        if families and family not in families:
            continue
        for rank in ranks:
            try:
                names = sorted(os.listdir(os.path.join(root, family_dir, f"rank={rank}")))
            except OSError:
                continue
            for name in names:
                parsed = None if name.startswith((".", "_")) else _parse_part(name)
                if parsed is not None and parsed[2] == run_id:
                    out.append(
                        (family, rank, os.path.join(root, family_dir, f"rank={rank}", name), *parsed[:2])
                    )
    return out
