"""`trainermon.load`: read a trainermon Parquet dataset (or a part of it) as one tidy table.

Only the files that can hold requested rows are opened: the family and rank filters choose partition
directories, and the step filter compares against the step range in each part file's name. The
remaining filters (names, run ids, exact steps) are pushed down to the Parquet reader, which skips row
groups by their statistics.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from trainermon.exporters.parquet_files import (
    COLUMNS,
    POINTER_FILE,
    file_schema,
    find_dataset,
    parse_part_name,
    partition_schema,
)

#: Columns of the returned table, in order.
OUTPUT_COLUMNS = ("run_id", "rank", "family") + tuple(c for c in COLUMNS if c != "run_id")


def _as_list(value: Any, what: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, (str, int)):
        return [value]
    if isinstance(value, Iterable):
        values = list(value)
        if not values:  # an empty selection would otherwise read as "no filter": every row
            raise ValueError(
                f"trainermon.load: {what}=[] selects nothing; allowed: a value, a list, or None (all)"
            )
        return values
    raise TypeError(f"trainermon.load: {what} must be a value or a list of values, got {value!r}")


def _rank_order(directory: str) -> tuple[int, int | str]:
    """rank=2 before rank=10 (numeric order); anything unexpected after, by name."""
    value = directory[len("rank=") :]
    return (0, int(value)) if value.lstrip("-").isdigit() else (1, value)


STEPS_ALLOWED = "an int, an inclusive (first, last) tuple, a range, a list of ints, or 'N' / 'FIRST-LAST'"


def _step_filter(steps: Any) -> tuple[int, int, list[int] | None] | None:
    """(lo, hi, exact list or None) from an int, an inclusive (lo, hi) tuple, a range, a list, or the
    CLI's `--steps` text ("N" or "FIRST-LAST")."""
    if steps is None:
        return None
    if isinstance(steps, bool):
        raise TypeError(f"trainermon.load: steps={steps!r}; allowed: {STEPS_ALLOWED}")
    if isinstance(steps, int):
        return steps, steps, None
    if isinstance(steps, str):
        first, sep, last = steps.strip().partition("-")
        last = last if sep else first  # "5-" is refused, as the CLI refuses it
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ValueError(f"trainermon.load: steps={steps!r}; allowed: {STEPS_ALLOWED}")
        return int(first), int(last), None
    if isinstance(steps, range):
        if len(steps) == 0:
            raise ValueError(f"trainermon.load: steps={steps!r} selects nothing; allowed: {STEPS_ALLOWED}")
        exact = None if steps.step == 1 else list(steps)
        return min(steps), max(steps), exact
    if isinstance(steps, tuple) and len(steps) == 2:
        lo, hi = steps
        lo = -(2**62) if lo is None else int(lo)
        hi = 2**62 if hi is None else int(hi)
        if hi < lo:
            raise ValueError(f"trainermon.load: steps={steps!r}: first > last; allowed: {STEPS_ALLOWED}")
        return lo, hi, None
    if isinstance(steps, Iterable):
        exact = sorted({int(s) for s in steps})
        if not exact:
            raise ValueError(f"trainermon.load: steps={steps!r} selects nothing; allowed: {STEPS_ALLOWED}")
        return exact[0], exact[-1], exact
    raise TypeError(f"trainermon.load: steps={steps!r}; allowed: {STEPS_ALLOWED}")


def resolve_dataset(path: str | os.PathLike) -> tuple[str, str | None]:
    """(dataset root, run id or None) for a dataset root, an output root or a rank's run directory.
    Raises FileNotFoundError when `path` is none of them (a typo must not read as an empty table)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trainermon.load: {path!r} is not a directory or a Parquet part file")
    found = find_dataset(path)
    if found is not None:
        return found
    raise FileNotFoundError(
        f"trainermon.load: no trainermon Parquet dataset at {path!r}: expected a dataset root "
        "(family=*/rank=*/part-*.parquet), an output root holding one under parquet/, or a run directory "
        f"with {POINTER_FILE}"
    )


def select_files(
    root: str,
    families: list[str] | None = None,
    ranks: list[int] | None = None,
    step_range: tuple[int, int] | None = None,
) -> list[str]:
    """Part files under `root` that can hold rows of the given families, ranks and step range."""
    files: list[str] = []
    try:
        family_dirs = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name.startswith("family="))
    except FileNotFoundError:
        return []
    for fdir in family_dirs:
        if families is not None and fdir[len("family=") :] not in families:
            continue
        fpath = os.path.join(root, fdir)
        rank_dirs = [e.name for e in os.scandir(fpath) if e.is_dir() and e.name.startswith("rank=")]
        for rdir in sorted(rank_dirs, key=_rank_order):
            value = rdir[len("rank=") :]
            if ranks is not None and (not value.lstrip("-").isdigit() or int(value) not in ranks):
                continue
            rpath = os.path.join(fpath, rdir)
            for name in sorted(os.listdir(rpath)):
                if name.startswith((".", "_")) or not name.endswith(".parquet"):
                    continue  # temporary (incomplete) files and side files
                span = parse_part_name(name)
                if step_range is not None and span is not None:
                    if span[1] < step_range[0] or span[0] > step_range[1]:
                        continue
                files.append(os.path.join(rpath, name))
    return files


def _check_ranks(root: str, families: list[str] | None, ranks: list[int]) -> None:
    """Raise, as for a missing family, when a rank asked for has no partition in the families read (a
    wrong rank must not read as an empty table); name the ranks that are there."""
    present: set[int] = set()
    for fdir in os.scandir(root):
        if not fdir.is_dir() or not fdir.name.startswith("family="):
            continue
        if families is not None and fdir.name[len("family=") :] not in families:
            continue
        for rdir in os.scandir(fdir.path):
            value = rdir.name[len("rank=") :]
            if rdir.is_dir() and rdir.name.startswith("rank=") and value.lstrip("-").isdigit():
                present.add(int(value))
    unknown = sorted({r for r in ranks if r not in present})
    if unknown:
        which = "" if families is None else f" for families {families}"
        raise ValueError(
            f"trainermon.load: ranks {unknown} are not in {root!r}{which} (it has ranks {sorted(present)})"
        )


def load(
    path: str | os.PathLike,
    family: str | Iterable[str] | None = None,
    names: str | Iterable[str] | None = None,
    steps: Any = None,
    as_pandas: bool = False,
    ranks: int | Iterable[int] | None = None,
    run_id: str | Iterable[str] | None = None,
    columns: Iterable[str] | None = None,
) -> Any:
    """Load trainermon statistics from Parquet as a pyarrow Table (a pandas DataFrame with `as_pandas`).

    path: the dataset root (`{MONITOR_OUTPUT_DIR}/parquet` by default), the output root containing it,
        a rank's run directory (then only that run's rows), or one part file.
    family, names, ranks, run_id: one value or a list of values (names match exactly).
    steps: an int, an inclusive `(first, last)` tuple (either may be None), a range, a list of steps, or
        the CLI's text form `"N"` / `"FIRST-LAST"`.
    columns: a subset of the output columns (default all, in the order of `OUTPUT_COLUMNS`).

    Rows come sorted by family, rank and step, each step's rows in the order they were written.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    families = _as_list(family, "family")
    name_list = _as_list(names, "names")
    rank_list = [int(r) for r in _as_list(ranks, "ranks") or []] or None
    run_ids = _as_list(run_id, "run_id")
    step_spec = _step_filter(steps)
    columns = None if columns is None else list(columns)  # a generator is read once
    unknown = [c for c in columns or () if c not in OUTPUT_COLUMNS]
    if unknown:  # before any file is read
        raise ValueError(f"trainermon.load: columns {unknown} do not exist; allowed: {list(OUTPUT_COLUMNS)}")
    path = os.fspath(path)

    full_schema = pa.schema(list(partition_schema()) + list(file_schema()))
    if os.path.isfile(path):
        root, files = os.path.dirname(path), [path]
        dataset = ds.dataset(files, schema=file_schema(), format="parquet")
        table = dataset.to_table()
        import pyarrow.parquet as pq

        # the file's own schema: the dataset's (`file_schema()`) carries no metadata
        meta = pq.read_schema(path).metadata or {}
        fam = meta.get(b"trainermon.family", b"").decode() or None
        rank = int(meta.get(b"trainermon.rank", b"0"))
        table = table.append_column("family", pa.array([fam] * len(table), pa.string()))
        table = table.append_column("rank", pa.array([rank] * len(table), pa.int32()))
        expr = _expression(families, name_list, rank_list, run_ids, step_spec)
        if expr is not None:
            table = table.filter(expr)
    else:
        root, pointed_run = resolve_dataset(path)
        if pointed_run is not None and run_ids is None:
            run_ids = [pointed_run]
        step_range = None if step_spec is None else (step_spec[0], step_spec[1])
        if families is not None:
            present = [e.name[len("family=") :] for e in os.scandir(root) if e.name.startswith("family=")]
            unknown = [f for f in families if f not in present]
            if unknown:
                raise ValueError(
                    f"trainermon.load: families {unknown} are not in {root!r} (it has {sorted(present)})"
                )
        if rank_list is not None:
            _check_ranks(root, families, rank_list)
        files = select_files(root, families, rank_list, step_range)
        if not files:
            table = full_schema.empty_table()
        else:
            expr = _expression(families, name_list, rank_list, run_ids, step_spec)
            table = _dataset(root, files, full_schema).to_table(filter=expr)
            if not len(table) and run_id is not None:  # a wrong run id must not read as an empty table
                every = _dataset(root, select_files(root, None, None, None), full_schema)
                there = set(every.to_table(columns=["run_id"]).column("run_id").unique().to_pylist())
                if not there & set(run_ids):
                    raise ValueError(
                        f"trainermon.load: run ids {run_ids} are not in {root!r} (it has {sorted(there)})"
                    )
            if not len(table) and name_list is not None:  # a mistyped name must not read as no rows
                every = _dataset(root, select_files(root, families, rank_list, None), full_schema)
                _check_names(name_list, every.to_table(columns=["name"]).column("name"), root)
    order = list(columns) if columns is not None else list(OUTPUT_COLUMNS)
    table = table.select(order)
    if len(table) and {"family", "rank", "step"} <= set(order):
        table = table.take(
            pc.sort_indices(table, [("family", "ascending"), ("rank", "ascending"), ("step", "ascending")])
        )
    if as_pandas:
        return table.to_pandas()
    return table


def _dataset(root: str, files: list[str], schema: Any) -> Any:
    """The part `files` of the dataset at `root` as one pyarrow dataset (family and rank from their paths)."""
    import pyarrow.dataset as ds

    partitioning = ds.partitioning(partition_schema(), flavor="hive")
    return ds.dataset(
        files, schema=schema, format="parquet", partitioning=partitioning, partition_base_dir=root
    )


def _check_names(names: list[str], present: Any, where: str) -> None:
    """ValueError when none of `names` is among the `present` names (any step), naming close ones."""
    import difflib

    import pyarrow.compute as pc

    there = set(pc.unique(present).to_pylist())
    if there & set(names):
        return  # some are there: their rows are outside the other filters
    close = sorted({c for n in names for c in difflib.get_close_matches(n, sorted(there), n=3)})
    raise ValueError(
        f"trainermon.load: names {names[:10]} are not in {where!r} (names match exactly; "
        f"{len(there)} names there{', close: ' + str(close) if close else ''})"
    )


def _expression(families, names, ranks, run_ids, step_spec):
    import pyarrow.dataset as ds

    parts = []
    if families is not None:
        parts.append(ds.field("family").isin(families))
    if ranks is not None:
        parts.append(ds.field("rank").isin(ranks))
    if names is not None:
        parts.append(ds.field("name").isin(names))
    if run_ids is not None:
        parts.append(ds.field("run_id").isin(run_ids))
    if step_spec is not None:
        lo, hi, exact = step_spec
        parts.append((ds.field("step") >= lo) & (ds.field("step") <= hi))
        if exact is not None:
            parts.append(ds.field("step").isin(exact))
    if not parts:
        return None
    expr = parts[0]
    for p in parts[1:]:
        expr = expr & p
    return expr
