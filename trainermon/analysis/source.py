"""Open a RUN directory and stream its rows in bounded batches.

A RUN is any of (detected in this order):

- a trainermon Parquet dataset root (`family=.../rank=.../part-*.parquet`, written by the Parquet
  exporter or by `trainermon convert`);
- a MONITOR_OUTPUT_DIR holding such a dataset in `parquet/`;
- a rank's run directory with a `parquet.json` pointer (then only that run's rows);
- a directory with CSV output, trainermon's or msprobe's (the same layout:
  `{time}-rank{R}-{id}/{family}_{first}-{last}.csv`, at any depth).

`prefer="csv"` reads the CSV files of a directory that holds both. Rows come as `Batch` objects of at
most `batch_size` rows, one file at a time, in a deterministic order: by family, then by rank (numeric),
then by step range. Family, rank and step-range filters choose files before any is opened; the step
filter and the column projection are pushed into `pyarrow.dataset` (Parquet) and applied per block
(CSV). Nothing reads a whole dataset into memory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainermon.collect.records import FAMILIES

#: Statistics the analysis knows (float statistics, then counts).
FLOAT_STATS = ("norm", "mean", "min", "max", "zeros")
COUNT_STATS = ("nans", "infs")
ALL_STATS = FLOAT_STATS + COUNT_STATS

_CSV_FILE = re.compile(r"^(?P<family>.+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")
_RANK_DIR = re.compile(r"rank(?P<rank>\d+)(?:-(?P<id>[^/\\]+))?$")
_VPP_PREFIX = re.compile(r"^(?P<vpp>\d+):(?P<name>.*)$")
_INT = re.compile(r"-?\d+")
_DATASET_MARKER = "_trainermon_dataset.json"
_POINTER = "parquet.json"


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
        inner = _has_partitions(path) or _RANK_DIR.search(os.path.basename(path)) is not None
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
        for f in self.files:
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
        wanted = [s for s in stats if s in ALL_STATS]
        chosen = files if files is not None else self.select(families, ranks, steps)
        for f in chosen:
            if self.kind == "parquet":
                yield from _parquet_batches(f, wanted, with_numel, steps, self.run_id, batch_size)
            else:
                yield from _csv_batches(f, wanted, with_numel, steps, batch_size)
            if on_file_done is not None:
                on_file_done(f)


# ---- detection --------------------------------------------------------------------------------------
def _has_partitions(path: str) -> bool:
    if os.path.isfile(os.path.join(path, _DATASET_MARKER)):
        return True
    try:
        return any(e.name.startswith("family=") and e.is_dir() for e in os.scandir(path))
    except OSError:
        return False


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
        root, pointed = None, None
        if _has_partitions(path):
            root = path
        elif _has_partitions(os.path.join(path, "parquet")):
            root = os.path.join(path, "parquet")
        elif os.path.isfile(os.path.join(path, _POINTER)):
            with open(os.path.join(path, _POINTER), encoding="utf-8") as fh:
                pointer = json.load(fh)
            root, pointed = pointer["dataset"], pointer.get("run_id")
        if root is not None:
            wanted_run = run_id if run_id is not None else pointed
            files = _parquet_files(root, wanted_run)
            if files:
                source = RunSource(path, "parquet", root, files, wanted_run)
                _note_mixed_runs(source)
                return source
        if prefer == "parquet":
            raise FileNotFoundError(f"no trainermon Parquet dataset at {path!r}")
    files = _csv_files(path, run_id)
    if not files:
        raise FileNotFoundError(
            f"no monitor output under {path!r}: expected a Parquet dataset (family=*/rank=*/part-*.parquet) "
            "or CSV files named {family}_{first}-{last}.csv"
        )
    first_per_family = {f.family: f.path for f in reversed(files)}
    kind = "msprobe-csv" if any(_looks_msprobe(p) for p in first_per_family.values()) else "csv"
    source = RunSource(path, kind, path, files, run_id)
    _note_mixed_runs(source)
    return source


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
    out.sort(key=lambda f: (family_order(f.family), f.family, f.rank, os.path.basename(f.path)))
    return out


def _csv_files(path: str, run_id: str | None) -> list[SourceFile]:
    out: list[SourceFile] = []
    for directory, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("family=", "."))]  # never descend into a dataset
        base = os.path.basename(os.path.normpath(directory))
        match = _RANK_DIR.search(base)
        rank = int(match.group("rank")) if match else 0
        rid = (match.group("id") if match else None) or base
        if run_id is not None and rid != run_id:
            continue
        for name in names:
            m = _CSV_FILE.match(name)
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
    return len(cells) > name_at and _VPP_PREFIX.match(cells[name_at]) is not None


def _note_mixed_runs(source: RunSource) -> None:
    runs: dict[tuple[str, int], set] = {}
    for f in source.files:
        runs.setdefault((f.family, f.rank), set()).add(f.run_id)
    mixed = sorted({rank for (_fam, rank), ids in runs.items() if len(ids) > 1})
    if mixed:
        source.notes.append(
            f"ranks {mixed[:10]} hold rows of more than one run id (restarts or several jobs in one "
            "directory); rows of the same step are combined as if they were shards. Pass run_id to keep one."
        )


# ---- reading ----------------------------------------------------------------------------------------
def _to_float(column: Any) -> tuple[np.ndarray, np.ndarray | None]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.type != pa.float64():
        column = pc.cast(column, pa.float64())
    valid = None
    if column.null_count:
        valid = np.asarray(column.is_valid())
        column = column.fill_null(np.nan)
    return column.to_numpy(zero_copy_only=False), valid


def _to_int(column: Any, default: int, n: int) -> np.ndarray:
    import pyarrow as pa

    if column is None:
        return np.full(n, default, dtype=np.int64)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        column = column.fill_null(default)
    return column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _unwrapped(name: str) -> str:
    """A name without leading `module.` segments: msprobe names parameters through the wrappers
    (`module.module.layers.0...` under DDP and Float16Module), trainermon as the model names them. A model
    whose own top-level attribute is called `module` loses that prefix too, in every run read."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _tensors(names: Any, vpp: np.ndarray | None) -> tuple[list[tuple[int, str]], np.ndarray]:
    """(vpp, name) pairs in order of first appearance and each row's index into them. msprobe's
    `{vpp}:{name}` prefix and wrapper `module.` prefixes are removed; its vpp counts where the file has
    no vpp_stage column."""
    import pyarrow as pa

    if isinstance(names, pa.ChunkedArray):
        names = names.combine_chunks()
    if not isinstance(names.type, pa.DictionaryType):
        names = names.dictionary_encode()
    codes = names.indices.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    dictionary = names.dictionary.to_pylist()
    stripped, prefix_vpp = [], []
    for name in dictionary:
        m = _VPP_PREFIX.match(name) if name is not None else None
        if m is not None:
            stripped.append(_unwrapped(m.group("name")))
            prefix_vpp.append(int(m.group("vpp")))
        else:
            stripped.append("" if name is None else _unwrapped(name))
            prefix_vpp.append(0)
    if vpp is None:
        row_vpp = np.asarray(prefix_vpp, dtype=np.int64)[codes] if codes.size else codes
    else:
        row_vpp = vpp
    width = max(len(dictionary), 1)
    combined = row_vpp * width + codes
    uniq, first_index, inverse = np.unique(combined, return_index=True, return_inverse=True)
    order = np.argsort(first_index, kind="stable")  # first appearance in the batch = model order
    rank_of = np.empty(len(uniq), dtype=np.int64)
    rank_of[order] = np.arange(len(uniq))
    tensors = [(int(uniq[i] // width), stripped[int(uniq[i] % width)]) for i in order]
    return tensors, rank_of[inverse.ravel()]


def _numel_from_shapes(shapes: Any) -> np.ndarray:
    import pyarrow as pa

    if isinstance(shapes, pa.ChunkedArray):
        shapes = shapes.combine_chunks()
    enc = shapes.dictionary_encode()
    values = []
    for text in enc.dictionary.to_pylist():
        dims = [int(v) for v in _INT.findall(text)] if text else None
        values.append(float(np.prod(dims)) if dims is not None else np.nan)
    codes = enc.indices
    lut = np.asarray(values + [np.nan], dtype=np.float64)
    idx = codes.fill_null(len(values)).to_numpy(zero_copy_only=False).astype(np.int64)
    return lut[idx]


def _make_batch(table: Any, family: str, rank: int, stats: list[str], with_numel: bool, path: str) -> Batch:
    names_present = table.column_names
    n = table.num_rows
    vpp = _to_int(table.column("vpp_stage"), 0, n) if "vpp_stage" in names_present else None
    name_col = "name" if "name" in names_present else "param_name"
    tensors, codes = _tensors(table.column(name_col), vpp)
    step = _to_int(table.column("step"), 0, n)
    micro = _to_int(table.column("micro_step") if "micro_step" in names_present else None, -1, n)
    values = {s: _to_float(table.column(s)) for s in stats if s in names_present}
    numel = None
    if with_numel:
        if "numel" in names_present:
            numel = _to_float(table.column("numel"))[0]
        elif "shape" in names_present:
            numel = _numel_from_shapes(table.column("shape"))
        else:
            numel = np.full(n, np.nan)
    return Batch(family, rank, tensors, codes, step, micro, values, numel, path)


def _parquet_batches(
    f: SourceFile,
    stats: list[str],
    with_numel: bool,
    steps: tuple[int, int] | None,
    run_id: str | None,
    batch_size: int,
) -> Iterator[Batch]:
    import pyarrow.dataset as ds

    fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=["name"]))
    dataset = ds.dataset(f.path, format=fmt)
    present = set(dataset.schema.names)
    columns = [c for c in ("vpp_stage", "name", "step", "micro_step") if c in present]
    columns += [s for s in stats if s in present]
    if with_numel:
        columns += [c for c in ("numel",) if c in present]
    expr = None
    if steps is not None and not (
        f.first_step is not None and steps[0] <= f.first_step and f.last_step <= steps[1]
    ):
        expr = (ds.field("step") >= steps[0]) & (ds.field("step") <= steps[1])
    if run_id is not None and f.run_id is None and "run_id" in present:
        run_expr = ds.field("run_id") == run_id
        expr = run_expr if expr is None else expr & run_expr
    # One file at a time, little read-ahead: memory stays at about one row group's decoded columns.
    batches = dataset.to_batches(
        columns=columns, filter=expr, batch_size=batch_size, batch_readahead=1, fragment_readahead=1
    )
    for record_batch in batches:
        if record_batch.num_rows:
            yield _make_batch(record_batch, f.family, f.rank, stats, with_numel, f.path)


def _csv_batches(
    f: SourceFile, stats: list[str], with_numel: bool, steps: tuple[int, int] | None, batch_size: int
) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    header = _read_header(f.path)
    if "step" not in header or not ({"name", "param_name"} & set(header)):
        raise ValueError(f"{f.path}: a CSV file without 'name' and 'step' columns (columns: {header})")
    types: dict[str, Any] = {"name": pa.string(), "param_name": pa.string(), "step": pa.int64()}
    types.update({"vpp_stage": pa.int64(), "micro_step": pa.int64(), "shape": pa.string()})
    types.update({s: pa.float64() for s in ALL_STATS + ("numel",)})
    wanted = ["vpp_stage", "name", "param_name", "step", "micro_step"] + stats
    if with_numel:
        wanted += ["numel"] if "numel" in header else ["shape"]
    include = [c for c in wanted if c in header]
    reader = pcsv.open_csv(
        f.path,
        read_options=pcsv.ReadOptions(block_size=1 << 22),
        convert_options=pcsv.ConvertOptions(
            column_types={k: v for k, v in types.items() if k in header},
            include_columns=include,
            null_values=[""],  # "nan", "inf" are values, as both tools write them
            strings_can_be_null=False,
        ),
    )
    for record_batch in reader:
        table = pa.Table.from_batches([record_batch])
        if steps is not None:
            step = table.column("step")
            table = table.filter(pc.and_(pc.greater_equal(step, steps[0]), pc.less_equal(step, steps[1])))
        for start in range(0, table.num_rows, batch_size):
            part = table.slice(start, batch_size)
            if part.num_rows:
                yield _make_batch(part, f.family, f.rank, stats, with_numel, f.path)
