"""Findings of the cross-rank summaries (family `xrank`, written by rank 0): which rank, which layer,
which step. The rows are few (one per tensor, statistic and collected step, whatever the number of
ranks); every engine fetches them (pyarrow here, SQL in `sqlplan.xrank_sql`) and this one function
turns them into findings, so they are the same whatever the engine."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from .jsonutil import jsonable
from .runs import multi_run, run_order
from .source import RunSource, SourceFile, family_order
from .sqlplan import XRANK_COLUMNS

#: Rows listed at the first non-finite step.
MAX_LISTED = 50
_MODULE = re.compile(r"^(module[.])+")  # the readers drop these wrappers from names


def read_xrank(source: RunSource, steps: tuple[int, int] | None = None) -> pd.DataFrame | None:
    """The run's xrank rows with pyarrow (None when it has none). A step several runs wrote (a restart
    into the same directory) is read from the latest-started run only, as the tensor families
    (`runs.py`); costs one read per run then, one boolean mask over the rows (few)."""
    files = source.select(["xrank"], None, steps)
    if not files:
        return None
    order = run_order(source) if multi_run(files) else {}
    if not order:
        return _read_files(source, files, steps)
    frames = []
    for rid in dict.fromkeys(f.run_id for f in files):  # file order: tensors keep their first appearance
        df = _read_files(source, [f for f in files if f.run_id == rid], steps)
        if df is not None:
            frames.append(df.assign(_run=order.get(rid, -1)))
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    latest = df.groupby("step")["_run"].transform("max")  # xrank is one (family, rank): the key is the step
    return df[df["_run"] == latest].drop(columns="_run").reset_index(drop=True)


def _read_files(
    source: RunSource, files: list[SourceFile], steps: tuple[int, int] | None
) -> pd.DataFrame | None:
    if source.kind == "csv":
        return _read_xrank_csv([f.path for f in files], steps)
    if source.kind != "parquet":
        return None
    import pyarrow as pa
    import pyarrow.dataset as ds

    dataset = ds.dataset([f.path for f in files], format="parquet")
    present = [c for c in XRANK_COLUMNS if c in dataset.schema.names]
    expr = None
    if steps is not None:
        expr = (ds.field("step") >= steps[0]) & (ds.field("step") <= steps[1])
    if source.run_id is not None and "run_id" in dataset.schema.names:
        run = ds.field("run_id") == source.run_id
        expr = run if expr is None else expr & run
    table = dataset.to_table(columns=present, filter=expr)
    if "micro_step" in present:
        idx = present.index("micro_step")
        table = table.set_column(idx, "micro_step", table.column("micro_step").cast(pa.int32()))
    return table.to_pandas()


def _read_xrank_csv(paths: list[str], steps: tuple[int, int] | None) -> pd.DataFrame | None:
    """Rank 0's `xrank_*.csv` as the Parquet columns (`convert` maps them the same way)."""
    import csv

    out: dict[str, list] = {c: [] for c in XRANK_COLUMNS}
    for path in paths:
        with open(path, newline="", encoding="utf-8") as fh:
            for r in csv.DictReader(fh):
                step = int(r["step"])
                if steps is not None and not steps[0] <= step <= steps[1]:
                    continue
                out["vpp_stage"].append(int(r["vpp_stage"] or 0))
                out["name"].append(r["name"])
                out["step"].append(step)
                out["micro_step"].append(int(r["micro_step"]) if r.get("micro_step") else -1)
                out["xrank_family"].append(r["family"])
                out["xrank_stat"].append(r["stat"])
                for key in ("max", "min", "mean", "nans", "infs"):
                    out[key].append(float(r[key]) if r.get(key) not in (None, "") else math.nan)
                for key in ("max_rank", "min_rank", "nonfinite_rank", "ranks"):
                    out[key].append(int(r[key]))
    return pd.DataFrame(out) if out["step"] else None


def _rank(value: Any) -> int | None:
    if value is None or pd.isna(value) or int(value) < 0:
        return None
    return int(value)


def _micro(value: Any) -> int | None:
    return _rank(value)  # -1 or null: the family has no micro-steps


def _positions(df: pd.DataFrame, grids: dict[str, Any] | None) -> np.ndarray:
    """Each row's tensor in model order: its position in the scan's grid of its family (as
    `trends.first_nonfinite`), else (no grid, or a tensor the grid lacks) after those, by first
    appearance in the xrank rows (written in hook order)."""
    first_seen: dict[tuple, int] = {}
    grid_pos: dict[str, dict[tuple, int]] = {}
    out = np.empty(len(df), dtype=np.int64)
    for i, (fam, vpp, name) in enumerate(zip(df["xrank_family"], df["vpp_stage"], df["name"])):
        key = (int(vpp), _MODULE.sub("", str(name)))
        if fam not in grid_pos:
            grid = (grids or {}).get(fam)
            order = [] if grid is None else [grid.tensors.keys[j] for j in grid.order()]
            grid_pos[fam] = {k: j for j, k in enumerate(order)}
        pos = grid_pos[fam].get(key)
        out[i] = pos if pos is not None else (1 << 40) + first_seen.setdefault((fam, *key), i)
    return out


def xrank_findings(df: pd.DataFrame | None, grids: dict[str, Any] | None = None) -> dict | None:
    """{rows, first_nonfinite: {step, micro_step, family, name, stat, rank, rows: [...]}, largest:
    [{family, stat, name, step, micro_step, max, max_rank}] (per summarised family and statistic, the
    row with the largest finite max over the run; ties: earliest step, then name)}.

    grids: the scan's grids (`RunSummary.grids`), whose tensor order is the model order the first
    non-finite rows follow (as `trends.first_nonfinite`); without them, the rows' own order.
    Costs one pass over the rows (few: tensors x statistics x collected steps)."""
    if df is None or not len(df):
        return None
    df = df.copy()
    df["_micro"] = [math.inf if _micro(m) is None else m for m in df["micro_step"]]
    df["_fam"] = df["xrank_family"].map(family_order)
    nf = df["nonfinite_rank"].fillna(-1).astype(np.int64)
    bad = df[nf >= 0]
    first = None
    if len(bad):
        bad = bad.assign(_pos=_positions(bad, grids))
        # model order, not names: "head.input" must not come before "layers.2.input" of the same step
        bad = bad.sort_values(
            ["step", "_micro", "_fam", "xrank_family", "_pos", "nonfinite_rank", "xrank_stat"],
            kind="stable",
        )
        at = bad[bad["step"] == bad["step"].iloc[0]]
        rows = [
            {
                "family": str(r.xrank_family),
                "name": str(r.name),
                "vpp_stage": int(r.vpp_stage),
                "stat": str(r.xrank_stat),
                "step": int(r.step),
                "micro_step": _micro(r.micro_step),
                "rank": _rank(r.nonfinite_rank),
                "nans": jsonable(float(r.nans)),
                "infs": jsonable(float(r.infs)),
            }
            for r in at.head(MAX_LISTED).itertuples(index=False)
        ]
        first = {**rows[0], "rows": rows, "rows_at_step": int(len(at))}
    largest = []
    finite = df[np.isfinite(df["max"].astype(np.float64))]
    for (fam, stat), part in finite.groupby(["xrank_family", "xrank_stat"], sort=True):
        part = part.sort_values(["max", "step", "name"], ascending=[False, True, True], kind="stable")
        r = part.iloc[0]
        largest.append(
            {
                "family": str(fam),
                "stat": str(stat),
                "name": str(r["name"]),
                "step": int(r["step"]),
                "micro_step": _micro(r["micro_step"]),
                "max": float(r["max"]),
                "max_rank": _rank(r["max_rank"]),
            }
        )
    largest.sort(key=lambda d: (family_order(d["family"]), d["family"], d["stat"]))
    return {"rows": int(len(df)), "first_nonfinite": first, "largest": largest}
