"""`trainermon convert CSV_DIR OUT [--to parquet|tensorboard]`: CSV output (trainermon's or msprobe's)
into the Parquet layout, or into TensorBoard event files with msprobe's tags (one directory per rank
directory, as the TensorBoard sink writes them).

Input: a directory holding rank directories (`{time}-rank{R}-{id}/`, the layout both tools write) or
one such directory. Every `{family}_{first}-{last}.csv` in them is read. Columns are taken by header
name, so any subset and order of statistics works; `vpp_stage` (absent in old msprobe files: taken from
a `{vpp}:` name prefix, else 0), `micro_step`, `shape` and `dtype` are optional. Output: the same
dataset layout as the Parquet exporter (`OUT/family=.../rank=.../part-....parquet`). `--to tensorboard`:
`trainermon.csv2tb.to_tensorboard`.
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

from trainermon.collect.family_columns import EXTRA_COLUMNS
from trainermon.exporters.csv_files import FILE, RANK_DIR, VPP_PREFIX, shape_dims
from trainermon.exporters.parquet_files import (
    COUNT_STATS,
    PART_PREFIX,
    STATS,
    ColumnBuffer,
    parse_part_name,
    write_dataset_marker,
    write_part,
)

from .convert_runs import has_run_id, step_order

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
    """{directory: [(family, path), ...]} for every CSV file of the tool layout under `csv_dir`, in family,
    then numeric step order (as text "x_10-14" would come before "x_5-9")."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for directory, _dirs, files in os.walk(csv_dir):
        matches = [m for m in map(FILE.match, files) if m is not None]
        matches.sort(key=lambda m: (m.group("family"), int(m.group("first")), int(m.group("last"))))
        for match in matches:
            found[directory].append((match.group("family"), os.path.join(directory, match.group(0))))
    return dict(found)


class Written(list):
    """The paths written (a list, as before) and `replaced`: the earlier files of the same groups that a
    re-conversion removed once their replacements were complete."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced: list[str] = []
        self.notes: list[str] = []  # steps of the converted runs left out (a Parquet dataset holds them)


def _make_out(out: str) -> None:
    """OUT must be a directory, created if missing; anything else is an argument error naming it."""
    allowed = "allowed: a directory (created if missing)"
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"OUT {out!r} is a file; {allowed}")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:  # a file above it (NotADirectoryError), no permission, ...
        raise ValueError(f"OUT {out!r} cannot be created ({exc.strerror}); {allowed}") from exc


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
) -> Written:
    """Convert every CSV file under `csv_dir` into a Parquet dataset at `out`; return the written parts.

    A part holds whole steps and at most `rows_per_part` rows, unless one step alone has more (as the
    exporter's parts, a step is never split). Parts that an earlier conversion wrote for the same family,
    rank and run id are removed once the new ones are complete (`Written.replaced`): converting a run
    again, as it goes on, never duplicates rows, and a crash mid-way never loses them. The directories of
    one rank and run id (a dynamic reload renews it) are joined in step order. Refused before anything is
    written (ValueError): a step of a family in two directories of one rank and run id, and an OUT
    holding the Parquet exporter's own parts of the run."""
    csv_dir, out = os.fspath(csv_dir), os.fspath(out)
    if not os.path.isdir(csv_dir):
        raise FileNotFoundError(f"trainermon convert: {csv_dir!r} is not a directory")
    groups = find_csv_files(csv_dir)
    if not groups:
        raise FileNotFoundError(
            f"trainermon convert: no '{{family}}_{{first}}-{{last}}.csv' files under {csv_dir!r}"
        )
    _make_out(out)
    plan = _plan(groups, out)  # every check before anything is written or removed
    write_dataset_marker(out)
    written = Written()
    seen: dict[str, dict[tuple[str, int], set[int]]] = defaultdict(dict)  # run id: (family, rank): steps
    for group, paths, earlier in plan:
        parts: list[str] = []
        steps = seen[group[3]].setdefault((group[1], group[2]), set())
        try:
            _convert_group(group, paths, rows_per_part, csv_dir, compression, parts, steps)
        except BaseException:  # a bad CSV file: the group as it was, not half old and half new
            _remove_parts(parts, earlier)  # (a new part of an earlier one's name holds the same rows)
            raise
        written.extend(parts)
        if parts:  # only now: a crash before this point leaves the earlier parts in place
            _remove_parts(earlier, parts)
            written.replaced.extend(earlier)  # removed, or overwritten by a part of the same name
    from .parquet_left_out import parquet_left_out  # (reads the analysis' Parquet listing)

    for run_id, csv_steps in sorted(seen.items()):  # a dynamic run's Parquet phase: said, not silent
        dirs = [d for d in groups if _rank_and_run(d)[1] == run_id]
        note = parquet_left_out(dirs, run_id, csv_steps, skip=out)
        if note is not None:
            logger.warning("trainermon convert: %s", note)
            written.notes.append(note)
    return written


def _plan(groups: dict[str, list[tuple[str, str]]], out: str) -> list[tuple[tuple, list[str], list[str]]]:
    """[(group, its CSV paths in step order, its earlier converted parts)], refusing what a conversion
    would break: one step of a family in two directories of one (rank, run id), two id-less directories
    of one rank (`a/rank0`, `b/rank0`: their parts would replace each other), and parts of the run that
    `convert` did not write (the Parquet exporter's own, in its dataset). The directories of one rank and
    run id (a dynamic reload that changes the columns or the sinks opens a new one) are one group."""
    runs: dict[tuple[int, str], list[str]] = defaultdict(list)
    for directory in sorted(groups):
        rank, run_id = _rank_and_run(directory)
        if runs[(rank, run_id)] and not has_run_id(directory):
            raise ValueError(
                f"trainermon convert: {runs[(rank, run_id)][0]!r} and {directory!r} are both rank {rank} of "
                f"run {run_id!r}; allowed: one directory per rank and run (convert them into separate OUTs)"
            )
        runs[(rank, run_id)].append(directory)
    plan = []
    for (rank, run_id), directories in sorted(runs.items()):
        by_family: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for directory in directories:
            for family, path in groups[directory]:  # already in step order within a directory
                by_family[family].append((directory, path))
        for family, found in sorted(by_family.items()):
            paths = [p for _, p in found] if len(directories) == 1 else step_order(family, rank, found)
            group = (out, family, rank, run_id)
            earlier = _group_parts(group)
            foreign = [p for p in earlier if not _converted(p)]
            if foreign:
                raise ValueError(
                    f"OUT {out!r} holds parts of run {run_id!r} that convert did not write (the Parquet "
                    f"exporter's: {os.path.basename(foreign[0])}): converting would duplicate or replace "
                    "them; allowed: an OUT without that run's exporter parts (choose another OUT)"
                )
            plan.append((group, paths, earlier))
    return plan


def _converted(path: str) -> bool:
    """The part was written by `convert` (its footer names the CSV it came from)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception:  # noqa: BLE001 - unreadable: not known to be ours, never removed
        return False
    return b"trainermon.converted_from" in meta


def _convert_group(
    group: tuple[str, str, int, str],
    paths: list[str],
    rows_per_part: int,
    source: str,
    compression: str,
    parts: list[str],
    steps: set[int],
) -> None:
    """Write the parts of one (out, family, rank, run_id) group, adding each to `parts` once written and
    its steps to `steps`: whole steps, a part closed before the step that would take it past
    `rows_per_part` rows."""
    out, family, rank, run_id = group
    buffer = ColumnBuffer()
    for path in paths:
        rows = _read_csv(path)
        start = 0  # rows[start:] not yet in `buffer`
        for lo, hi in _step_runs(rows):
            steps.add(int(rows[lo]["step"]))
            held = buffer.rows + lo - start
            if held and held + hi - lo > rows_per_part:
                _extend(buffer, rows[start:lo], run_id)
                parts.append(_write(out, family, rank, run_id, len(parts), buffer, source, compression))
                buffer, start = ColumnBuffer(), lo
        _extend(buffer, rows[start:], run_id)
    if buffer.rows:
        parts.append(_write(out, family, rank, run_id, len(parts), buffer, source, compression))


def _step_runs(rows: list[dict[str, str]]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of consecutive rows of one step."""
    runs: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or int(rows[i]["step"]) != int(rows[lo]["step"]):
            runs.append((lo, i))
            lo = i
    return runs


def _extend(buffer: ColumnBuffer, rows: list[dict[str, str]], run_id: str) -> None:
    if rows:
        buffer.extend(_columns(rows, run_id), np.array([int(r["step"]) for r in rows]))


def _part_run_id(name: str) -> str | None:
    """The run id in a part file name (`part-{first}-{last}-{run_id}-{seq}.parquet`), None for others."""
    if parse_part_name(name) is None:
        return None
    middle = name[len(PART_PREFIX) : -len(".parquet")].split("-", 2)[2]
    return middle.rsplit("-", 1)[0] if "-" in middle else None


def _group_parts(group: tuple[str, str, int, str]) -> list[str]:
    """The part files of `group` (out, family, rank, run_id) already there."""
    out, family, rank, run_id = group
    directory = os.path.join(out, f"family={family}", f"rank={rank}")
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [os.path.join(directory, n) for n in names if _part_run_id(n) == run_id]


def _remove_parts(paths: list[str], keep: list[str]) -> None:
    """Remove `paths` but those in `keep`."""
    for path in set(paths) - set(keep):
        os.unlink(path)


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
