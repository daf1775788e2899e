"""The files of the Parquet dataset: schema, part-file names, the column buffer and atomic part writes.

Shared by the exporter (`exporters.parquet`), `trainermon convert` and the readers (`trainermon.load`,
the analysis engines), so the one schema lives in one place. No training state here."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from trainermon.collect.family_columns import EXTRA_COLUMNS
from trainermon.stats import table

#: Bumped on any incompatible change of the file schema or the layout.
SCHEMA_VERSION = 1
#: Statistic columns, from the statistics table: floats as float64, counts as int64.
FLOAT_STATS, COUNT_STATS = table.FLOAT_STATS, table.COUNT_STATS
STATS = FLOAT_STATS + COUNT_STATS
#: Columns of the tidy table as `trainermon.load` returns it, in order.
COLUMNS = (
    ("run_id", "vpp_stage", "name", "step", "micro_step")
    + STATS
    + ("numel", "shape", "dtype", "shard", "skipped", "calls", "bytes")
)
#: Columns of the cross-rank summaries (family `xrank`), added at the end; null in every other family.
XRANK_EXTRA = ("xrank_family", "xrank_stat", "max_rank", "min_rank", "nonfinite_rank", "ranks")
COLUMNS += XRANK_EXTRA
#: Columns of some families only, at the end of the schema (null in the other families' rows): `ratio`
#: (update), the moe_load columns (see `trainermon.collect.family_columns`).
EXTRA_FLOATS = tuple(name for name, kind, _ in EXTRA_COLUMNS if kind == "float")
EXTRA_INTS = tuple(name for name, kind, _ in EXTRA_COLUMNS if kind == "int")
EXTRA_FAMILIES = {name: families for name, _, families in EXTRA_COLUMNS}
COLUMNS += tuple(name for name, _, _ in EXTRA_COLUMNS)
#: Added after the family columns (older files read it as null): see `file_schema`.
COLUMNS += ("own_skip",)
PART_PREFIX = "part-"
DATASET_MARKER = "_trainermon_dataset.json"
POINTER_FILE = "parquet.json"  # in each rank's run directory: where its rows went


def has_partitions(path: str) -> bool:
    """Whether `path` is a dataset root: its marker file, or family=... directories."""
    if os.path.isfile(os.path.join(path, DATASET_MARKER)):
        return True
    try:
        return any(e.name.startswith("family=") and e.is_dir() for e in os.scandir(path))
    except OSError:
        return False


def find_dataset(path: str) -> tuple[str, str | None] | None:
    """(dataset root, run id or None) of what `path` is: a run directory (its POINTER_FILE), a dataset
    root, or an output root holding one under `parquet/` (the default dataset directory); None when it is
    none of them. `trainermon.load` and the analysis commands read their paths through this."""
    pointed = read_pointer(path)
    if pointed is not None:
        return pointed
    if has_partitions(path):
        return path, None
    under = os.path.join(path, "parquet")
    return (under, None) if has_partitions(under) else None


def pointer(run_dir: str, dataset: str, rank: int, run_id: str) -> dict:
    """What a run directory's POINTER_FILE says: the dataset's path, also relative to the run directory
    (so that a copied or moved output tree reads its own dataset), the rank and the run id."""
    return {"dataset": dataset, "relative": os.path.relpath(dataset, run_dir), "rank": rank, "run_id": run_id}


def read_pointer(run_dir: str) -> tuple[str, str | None] | None:
    """(dataset root, run id) of a run directory with a POINTER_FILE, None without one. The dataset is
    looked for relative to the run directory first, then (pointers written before `relative` existed)
    beside it under the same name, then at the absolute path written: output moved as a whole finds its
    own copy, never the original's."""
    path = os.path.join(run_dir, POINTER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        saved = json.load(fh)
    dataset = saved["dataset"]
    candidates = [os.path.join(run_dir, saved["relative"])] if "relative" in saved else []
    candidates += [
        os.path.join(os.path.dirname(os.path.abspath(run_dir)), os.path.basename(dataset)),
        dataset,
    ]
    found = next((c for c in candidates if has_partitions(c)), dataset)
    return os.path.normpath(found), saved.get("run_id")


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the parquet format needs pyarrow: pip install 'trainermon[parquet]'") from exc
    return pa, pq


def file_schema():
    """Schema of the columns stored in each part file (partition columns excluded)."""
    pa, _ = _pa()
    fields = [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("vpp_stage", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("micro_step", pa.int32()),  # null where the family has no micro-batches
    ]
    fields += [pa.field(s, pa.float64()) for s in FLOAT_STATS]  # null when not in the config's ops
    fields += [pa.field(s, pa.int64()) for s in COUNT_STATS]
    fields += [
        pa.field("numel", pa.int64()),  # null only in converted CSV without numel or shape
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("dtype", pa.string()),
        # Which piece of the tensor a rank's row holds where it holds only one (a DTensor's local shard);
        # null for whole tensors. Files written before this column read it as null.
        pa.field("shard", pa.string()),
        # The step's optimizer update was skipped (loss-scale overflow); null where no one said.
        pa.field("skipped", pa.bool_()),
        # `comm` rows: the collective calls a row sums over and the bytes they moved (null elsewhere).
        pa.field("calls", pa.int64()),
        pa.field("bytes", pa.int64()),
        # Family xrank (cross-rank summaries, rank 0): the summarised family and statistic (its max, min
        # and mean over ranks in those columns, nans and infs summed), the lowest rank holding the max
        # and the min, the lowest rank with a non-finite row (-1: none) and how many ranks held the row.
        pa.field("xrank_family", pa.string()),
        pa.field("xrank_stat", pa.string()),
        pa.field("max_rank", pa.int32()),
        pa.field("min_rank", pa.int32()),
        pa.field("nonfinite_rank", pa.int32()),
        pa.field("ranks", pa.int32()),
    ]
    types = {
        "float": pa.float64(),
        "int": pa.int64(),
        "list": pa.list_(pa.int64()),
        "flist": pa.list_(pa.float64()),
    }
    fields += [pa.field(name, types[kind]) for name, kind, _ in EXTRA_COLUMNS]  # older files: null
    # A skipped update (`skipped` true) that the training loop made itself, no loss scaler's overflow:
    # its Inf/NaN are anomalies. False where a scaler or the framework skipped or the update ran; null
    # where no one said, and in older files.
    fields.append(pa.field("own_skip", pa.bool_()))
    return pa.schema(fields)


def partition_schema():
    pa, _ = _pa()
    return pa.schema([pa.field("family", pa.string()), pa.field("rank", pa.int32())])


def part_name(first_step: int, last_step: int, run_id: str, seq: int) -> str:
    return f"{PART_PREFIX}{first_step:012d}-{last_step:012d}-{run_id}-{seq:05d}.parquet"


def parse_part_name(filename: str) -> tuple[int, int] | None:
    """(first_step, last_step) from a part file name, or None for other names."""
    if not filename.startswith(PART_PREFIX) or not filename.endswith(".parquet"):
        return None
    bits = filename[len(PART_PREFIX) :].split("-", 2)
    if len(bits) < 3 or not bits[0].isdigit() or not bits[1].isdigit():
        return None
    return int(bits[0]), int(bits[1])


def _trainermon_version() -> str:
    try:
        from trainermon import __version__

        return __version__
    except Exception:  # noqa: BLE001 - metadata only
        return "unknown"


def config_json(config: Any) -> str:
    if dataclasses.is_dataclass(config):
        return json.dumps(dataclasses.asdict(config), default=str, sort_keys=True)
    return json.dumps(config, default=str, sort_keys=True)


class ColumnBuffer:
    """Rows of one partition, kept column-wise until a part file is written.

    `extend` takes, per column: a list (strings, shapes), a numpy array, or for statistics either an
    array or None (not collected: stored as null); a column left out is null. `micro_step` is an int
    array where -1 means null.
    """

    def __init__(self) -> None:
        self.chunks: dict[str, list] = {c: [] for c in COLUMNS}
        self.sizes: list[int] = []
        self.rows = 0
        self.first_step: int | None = None
        self.last_step: int | None = None

    def extend(self, columns: dict[str, Any], steps: np.ndarray) -> None:
        n = len(steps)
        if n == 0:
            return
        for key in COLUMNS:
            self.chunks[key].append(columns.get(key))  # a column not given: null
        self.sizes.append(n)
        self.rows += n
        lo, hi = int(steps.min()), int(steps.max())
        self.first_step = lo if self.first_step is None else min(self.first_step, lo)
        self.last_step = hi if self.last_step is None else max(self.last_step, hi)

    def _stat(self, pa, name: str, typ):
        parts, masks = [], []
        for chunk, n in zip(self.chunks[name], self.sizes):
            if chunk is None:
                parts.append(np.zeros(n, dtype=np.float64))
                masks.append(np.ones(n, dtype=bool))
            else:
                parts.append(np.asarray(chunk, dtype=np.float64))
                masks.append(np.zeros(n, dtype=bool))
        data, mask = np.concatenate(parts), np.concatenate(masks)
        if name in COUNT_STATS:
            data = np.nan_to_num(data, nan=0.0).astype(np.int64)
        elif name in EXTRA_INTS:  # null where NaN
            mask = mask | np.isnan(data)
            data = np.nan_to_num(data, nan=0.0).astype(np.int64)
        return pa.array(data, type=typ, mask=mask if mask.any() else None)

    def to_table(self, metadata: dict[bytes, bytes]):
        pa, _ = _pa()
        schema = file_schema()
        arrays = []
        for field in schema:
            name = field.name
            if name in STATS or name in EXTRA_FLOATS or name in EXTRA_INTS:
                arrays.append(self._stat(pa, name, field.type))
            elif name in EXTRA_FAMILIES:  # a list column: None for a chunk without it
                values = []
                for chunk, n in zip(self.chunks[name], self.sizes):
                    values.extend([None] * n if chunk is None else list(chunk))
                arrays.append(pa.array(values, type=field.type))
            elif name == "micro_step":
                data = np.concatenate([np.asarray(c, dtype=np.int64) for c in self.chunks[name]])
                mask = data < 0
                arrays.append(pa.array(data, type=field.type, mask=mask if mask.any() else None))
            elif name == "step":
                arrays.append(pa.array(np.concatenate(self.chunks[name]), type=field.type))
            else:  # a chunk of None: a column the family does not have (nulls)
                values = [v for part, n in zip(self.chunks[name], self.sizes) for v in part or [None] * n]
                arrays.append(pa.array(values, type=field.type))
        return pa.Table.from_arrays(arrays, schema=schema.with_metadata(metadata))


def warm_up(compression: str = "zstd", compression_level: int | None = None) -> None:
    """Write a one-row table to memory, so that what pyarrow imports on its first table and write (pandas,
    through pyarrow.pandas_compat: 1-3 s on a busy host) is imported now, on the caller's thread at open,
    not inside the worker's first part while the CSV rows wait behind it on the same thread (the
    `write_interval_s` bound on what a kill loses). About 1 s once per process when pandas is not yet
    imported, a millisecond after."""
    pa, pq = _pa()
    buffer = ColumnBuffer()
    one = np.zeros(1, dtype=np.int64)
    buffer.extend({"run_id": ["w"], "vpp_stage": [0], "name": ["w"], "step": one, "micro_step": one - 1}, one)
    table = buffer.to_table({b"trainermon.warm_up": b"1"})
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        compression=None if compression == "none" else compression,
        compression_level=compression_level,
    )


def write_part(
    root: str,
    family: str,
    rank: int,
    run_id: str,
    seq: int,
    buffer: ColumnBuffer,
    metadata: dict[str, str],
    compression: str = "zstd",
    compression_level: int | None = None,
) -> str:
    """Write one complete part file atomically; return its final path."""
    _, pq = _pa()
    directory = os.path.join(root, f"family={family}", f"rank={rank}")
    os.makedirs(directory, exist_ok=True)
    assert buffer.first_step is not None and buffer.last_step is not None
    name = part_name(buffer.first_step, buffer.last_step, run_id, seq)
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp")  # hidden: dataset readers skip dot files
    meta = {
        "trainermon.schema_version": str(SCHEMA_VERSION),
        "trainermon.version": _trainermon_version(),
        "trainermon.family": family,
        "trainermon.rank": str(rank),
        "trainermon.run_id": run_id,
        "trainermon.first_step": str(buffer.first_step),
        "trainermon.last_step": str(buffer.last_step),
        "trainermon.stat_precision": "float32 runs of at most 16 terms, added in float64 (norm within 5e-7)",
        **metadata,
    }
    table = buffer.to_table({k.encode(): v.encode() for k, v in meta.items()})
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(
                table,
                fh,
                compression=None if compression == "none" else compression,
                compression_level=compression_level,
                row_group_size=max(len(table), 1),  # one large row group per part
            )
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not expose a file whose bytes are not yet on disk
        os.replace(tmp, final)
    except BaseException:
        _discard(tmp)  # a failed write (disk full) leaves no temporary file behind
        raise
    return final


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_dataset_marker(root: str) -> None:
    """A small description at the dataset root (underscore prefix: dataset readers skip it)."""
    path = os.path.join(root, DATASET_MARKER)
    if os.path.exists(path):
        return
    body = {
        "format": "trainermon parquet dataset",
        "schema_version": SCHEMA_VERSION,
        "partitioning": "hive: family=<family>/rank=<rank>",
        "columns": list(COLUMNS),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(body, fh, indent=2)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def default_root(output_root: str, configured: str | None) -> str:
    """The dataset root: `parquet.dir` under MONITOR_OUTPUT_DIR (the config refuses absolute paths and
    '..'; checked again here, so that no config can send the dataset elsewhere)."""
    root = os.path.normpath(os.path.join(output_root, "parquet" if configured is None else configured))
    if os.path.commonpath([root, os.path.normpath(output_root)]) != os.path.normpath(output_root):
        raise ValueError(f"parquet.dir {configured!r} is outside MONITOR_OUTPUT_DIR {output_root!r}")
    return root
