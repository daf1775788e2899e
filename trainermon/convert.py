"""`trainermon convert CSV_DIR OUT [--to parquet|tensorboard]`: CSV output (trainermon's or msprobe's)
into the Parquet layout, or into TensorBoard event files with msprobe's tags (one directory per rank
directory, as the TensorBoard sink writes them).

Input: a directory holding rank directories (`{time}-rank{R}-{id}/`, the layout both tools write) or
one such directory. Every `{family}_{first}-{last}.csv` in them is read. Columns are taken by header
name, so any subset and order of statistics works; `vpp_stage` (absent in old msprobe files: taken from
a `{vpp}:` name prefix, else 0), `micro_step`, `shape` and `dtype` are optional. Output: the same
dataset layout as the Parquet exporter (`OUT/family=.../rank=.../part-....parquet`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from collections import defaultdict
from typing import Any

import numpy as np

from trainermon.collect.family_columns import EXTRA_COLUMNS, FAMILY_COLUMNS
from trainermon.exporters.csv_files import FILE, RANK_DIR, VPP_PREFIX, shape_dims
from trainermon.exporters.parquet_files import (
    COUNT_STATS,
    STATS,
    ColumnBuffer,
    write_dataset_marker,
    write_part,
)
from trainermon.names import msprobe_tag

logger = logging.getLogger("trainermon")


def _number(text: str | None) -> float:
    if text is None or text == "":
        return math.nan
    try:
        return float(text)  # accepts nan, inf, -inf as both tools write them
    except ValueError:
        return math.nan


def _rank_and_run(directory: str) -> tuple[int, str]:
    base = os.path.basename(os.path.normpath(directory))
    match = RANK_DIR.search(base)
    if match is None:
        return 0, base or "csv"
    return int(match.group("rank")), match.group("id") or base


def _layout(directory: str) -> dict:
    """The run's `layout.json` (trainermon's CSV runs), {} where there is none (msprobe's, older ones)."""
    try:
        with open(os.path.join(directory, "layout.json"), encoding="utf-8") as fh:
            layout = json.load(fh)
    except (OSError, ValueError):
        return {}
    return layout if isinstance(layout, dict) else {}


def find_csv_files(csv_dir: str) -> dict[str, list[tuple[str, str]]]:
    """{directory: [(family, path), ...]} for every CSV file of the tool layout under `csv_dir`."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for directory, _dirs, files in os.walk(csv_dir):
        for name in sorted(files):
            match = FILE.match(name)
            if match is not None:
                found[directory].append((match.group("family"), os.path.join(directory, name)))
    return dict(found)


_NUMERIC = frozenset(STATS) | {"numel"}
_WHOLE = ("vpp_stage", "step", "micro_step")  # whole numbers; only `step` may not be empty
_WHOLE_NUMBER = re.compile(r"-?[0-9]+")


def _read_csv(path: str) -> list[dict[str, str]]:
    """The rows of one CSV file; a line cut by a crash or a non-number in a numeric column is an error
    naming the file and line (never a NaN, or a cut-short value, in the output)."""
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = []
        for row in reader:
            short = [k for k, v in row.items() if v is None]
            if None in row or short:
                what = "more fields than" if None in row else f"no value for {short} of"
                raise ValueError(
                    f"{path}, line {reader.line_num}: {what} the header's {len(reader.fieldnames)} "
                    "columns (a line cut by a crash, or edited by hand)"
                )
            for key in _WHOLE:
                text = row.get(key)
                if text is not None and not (
                    _WHOLE_NUMBER.fullmatch(text.strip()) or (text == "" and key != "step")
                ):
                    raise ValueError(
                        f"{path}, line {reader.line_num}: column {key!r}: {text!r} is not a whole number"
                    )
            for key in _NUMERIC.intersection(row):
                try:
                    if row[key] != "":
                        float(row[key])
                except ValueError:
                    raise ValueError(
                        f"{path}, line {reader.line_num}: column {key!r}: {row[key]!r} is not a number "
                        "(allowed: a number, nan, inf, -inf, or empty)"
                    ) from None
            rows.append(row)
        return rows


def convert(
    csv_dir: str | os.PathLike,
    out: str | os.PathLike,
    rows_per_part: int = 1_000_000,
    compression: str = "zstd",
) -> list[str]:
    """Convert every CSV file under `csv_dir` into a Parquet dataset at `out`; return the written parts."""
    csv_dir, out = os.fspath(csv_dir), os.fspath(out)
    if not os.path.isdir(csv_dir):
        raise FileNotFoundError(f"trainermon convert: {csv_dir!r} is not a directory")
    groups = find_csv_files(csv_dir)
    if not groups:
        raise FileNotFoundError(
            f"trainermon convert: no '{{family}}_{{first}}-{{last}}.csv' files under {csv_dir!r}"
        )
    os.makedirs(out, exist_ok=True)
    write_dataset_marker(out)
    written: list[str] = []
    for directory, files in sorted(groups.items()):
        rank, run_id = _rank_and_run(directory)
        by_family: dict[str, list[str]] = defaultdict(list)
        for family, path in files:
            by_family[family].append(path)
        for family, paths in sorted(by_family.items()):
            paths.sort(key=lambda p: int(FILE.match(os.path.basename(p)).group("first")))
            buffer, seq = ColumnBuffer(), 0
            for path in paths:
                rows = _read_csv(path)
                if rows:
                    buffer.extend(_columns(rows, run_id), np.array([int(r["step"]) for r in rows]))
                if buffer.rows >= rows_per_part:
                    written.append(_write(out, family, rank, run_id, seq, buffer, csv_dir, compression))
                    buffer, seq = ColumnBuffer(), seq + 1
            if buffer.rows:
                written.append(_write(out, family, rank, run_id, seq, buffer, csv_dir, compression))
    return written


def to_tensorboard(csv_dir: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write every CSV file under `csv_dir` as TensorBoard scalars under `out/{rank directory}`, tagged as
    the TensorBoard sink tags them; return the directories written. Needs the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(
            "trainermon convert --to tensorboard needs the tensorboard package: "
            "pip install 'trainermon[tensorboard]'"
        ) from exc
    csv_dir, out = os.fspath(csv_dir), os.fspath(out)
    groups = find_csv_files(csv_dir) if os.path.isdir(csv_dir) else {}
    if not groups:
        raise FileNotFoundError(
            f"trainermon convert: no '{{family}}_{{first}}-{{last}}.csv' files under {csv_dir!r}"
        )
    written = []
    for directory, files in sorted(groups.items()):
        rank, _run_id = _rank_and_run(directory)
        unreduced = _layout(directory).get("grad_unreduced_kind", "pre_grad")
        target = os.path.join(out, os.path.basename(os.path.normpath(directory)))
        writer = SummaryWriter(log_dir=target)
        try:
            for family, path in files:
                rows = _read_csv(path)
                if not rows:
                    continue
                columns = _columns(rows, "")
                stats = [s for s in STATS if columns.get(s) is not None]
                # as the TensorBoard sink: numel, and the family's own numbers (update: ratio; moe_load ...)
                stats += [c for c in ("numel",) if c in rows[0]] + [
                    c
                    for c, kind in FAMILY_COLUMNS.get(family, ())
                    if kind in ("float", "int") and c in rows[0]
                ]
                for i, r in enumerate(rows):
                    micro = int(columns["micro_step"][i])
                    prefix = msprobe_tag(
                        family,
                        columns["vpp_stage"][i],
                        columns["name"][i],
                        None if micro < 0 else micro,
                        rank,
                        unreduced,
                    )
                    for stat in stats:
                        writer.add_scalar(f"{prefix}_{stat}", _number(r[stat]), int(r["step"]))
        finally:
            writer.close()
        written.append(target)
    return written


def _write(
    out: str,
    family: str,
    rank: int,
    run_id: str,
    seq: int,
    buffer: ColumnBuffer,
    source: str,
    compression: str,
) -> str:
    meta = {"trainermon.converted_from": os.path.realpath(source)}
    return write_part(out, family, rank, run_id, seq, buffer, meta, compression)


def _columns(rows: list[dict[str, str]], run_id: str) -> dict[str, Any]:
    header = rows[0].keys()
    name_key = "name" if "name" in header else "param_name" if "param_name" in header else None
    if name_key is None or "step" not in header:
        raise ValueError(
            f"trainermon convert: a CSV file has no 'name' or 'step' column (columns: {list(header)})"
        )
    vpps, names = [], []
    for r in rows:
        name = r[name_key]
        vpp = r.get("vpp_stage")
        prefixed = VPP_PREFIX.match(name)
        if prefixed is not None:  # msprobe's "{vpp}:{name}" names
            name = prefixed.group("name")
            vpp = vpp if vpp not in (None, "") else prefixed.group("vpp")
        vpps.append(int(vpp) if vpp not in (None, "") else 0)
        names.append(name)
    n = len(rows)
    columns: dict[str, Any] = {
        "run_id": [run_id] * n,
        "vpp_stage": vpps,
        "name": names,
        "step": np.array([int(r["step"]) for r in rows], dtype=np.int64),
        "micro_step": np.array(
            [int(r["micro_step"]) if r.get("micro_step") not in (None, "") else -1 for r in rows],
            dtype=np.int64,
        ),
    }
    for stat in STATS:
        if stat in header:
            values = np.array([_number(r[stat]) for r in rows], dtype=np.float64)
            columns[stat] = np.nan_to_num(values, nan=0.0) if stat in COUNT_STATS else values
        else:
            columns[stat] = None
    shapes = [shape_dims(r.get("shape")) for r in rows]
    columns["shape"] = shapes
    if "numel" in header:
        columns["numel"] = [int(float(r["numel"])) for r in rows]
    else:  # from the shape; a non-tensor slot (a None output: dtype "None", shape []) has no elements
        columns["numel"] = [
            None if s is None else 0 if r.get("dtype") == "None" else int(np.prod(s))
            for s, r in zip(shapes, rows)
        ]
    columns["dtype"] = [r.get("dtype") or None for r in rows]
    columns["shard"] = [r.get("shard") or None for r in rows]  # absent in msprobe's and older CSV
    flags = [r.get("skipped") or "" for r in rows]  # 1: skipped, 2: skipped by the loop itself, 0: ran
    columns["skipped"] = [{"1": True, "2": True, "0": False}.get(f) for f in flags]
    columns["own_skip"] = [{"1": False, "2": True, "0": False}.get(f) for f in flags]
    for key in ("calls", "bytes"):  # comm rows only
        columns[key] = [int(r[key]) if r.get(key) else None for r in rows]
    if "stat" in header:  # xrank_*.csv: cross-rank summaries (family and stat say what they summarise)
        columns["xrank_family"] = [r["family"] for r in rows]
        columns["xrank_stat"] = [r["stat"] for r in rows]
        for key in ("max_rank", "min_rank", "nonfinite_rank", "ranks"):
            columns[key] = [int(r[key]) for r in rows]
    for extra, kind, _families in EXTRA_COLUMNS:  # family columns (update: ratio, ...), absent elsewhere
        if extra not in header:
            columns[extra] = None
        elif kind in ("list", "flist"):
            columns[extra] = [json.loads(r[extra]) if r[extra] else None for r in rows]
        else:
            columns[extra] = np.array([_number(r[extra]) for r in rows])
    return columns
