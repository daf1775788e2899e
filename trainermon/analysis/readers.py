"""Reading the files of a run into `Batch`es: Parquet through `pyarrow.dataset` (step filter and column
projection pushed down), CSV (trainermon's and msprobe's) in blocks. Names are read as the model names
them (msprobe's `{vpp}:` prefix and wrapper `module.` segments removed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trainermon.exporters.csv_files import VPP_PREFIX, shape_dims

from .source import ALL_STATS, Batch, SourceFile, _read_header


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
        m = VPP_PREFIX.match(name) if name is not None else None
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
        dims = shape_dims(text)
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
            if "dtype" in names_present:  # a None output's NaN row (shape [], dtype None): no elements
                import pyarrow.compute as pc

                numel[pc.equal(table.column("dtype"), "None").to_numpy(zero_copy_only=False)] = 0.0
        else:
            numel = np.full(n, np.nan)
    return Batch(family, rank, tensors, codes, step, micro, values, numel, path)


def parquet_batches(
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


def _blocks(reader: Any, path: str) -> Iterator[Any]:
    """The reader's record batches, streamed; a parse error names the file (a truncated last line)."""
    import pyarrow as pa

    while True:
        try:
            yield reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path}: {exc}") from exc


def csv_batches(
    f: SourceFile, stats: list[str], with_numel: bool, steps: tuple[int, int] | None, batch_size: int
) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    header = _read_header(f.path)
    if "step" not in header or not ({"name", "param_name"} & set(header)):
        raise ValueError(f"{f.path}: a CSV file without 'name' and 'step' columns (columns: {header})")
    types: dict[str, Any] = {"name": pa.string(), "param_name": pa.string(), "step": pa.int64()}
    types.update(
        {"vpp_stage": pa.int64(), "micro_step": pa.int64(), "shape": pa.string(), "dtype": pa.string()}
    )
    types.update({s: pa.float64() for s in ALL_STATS + ("numel",)})
    wanted = ["vpp_stage", "name", "param_name", "step", "micro_step"] + stats
    if with_numel:
        wanted += ["numel"] if "numel" in header else ["shape", "dtype"]
    include = [c for c in wanted if c in header]
    try:
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
    except pa.ArrowInvalid as exc:  # a damaged file among thousands: say which
        raise ValueError(f"{f.path}: {exc}") from exc
    for record_batch in _blocks(reader, f.path):
        table = pa.Table.from_batches([record_batch])
        if steps is not None:
            step = table.column("step")
            table = table.filter(pc.and_(pc.greater_equal(step, steps[0]), pc.less_equal(step, steps[1])))
        for start in range(0, table.num_rows, batch_size):
            part = table.slice(start, batch_size)
            if part.num_rows:
                yield _make_batch(part, f.family, f.rank, stats, with_numel, f.path)
