"""MoE expert load offline: the `moe_load` rows' per-expert token counts as a layer x expert table of the
last step the run has (in the step range asked for), read from Parquet or CSV."""

from __future__ import annotations

import csv
import json
from typing import Any

import pandas as pd

from .source import RunSource

FAMILY = "moe_load"


def expert_load_last_step(source: RunSource, steps: tuple[int, int] | None = None) -> pd.DataFrame | None:
    """Routers (rows, model order) x experts (columns) of tokens routed at the last step with rows; None
    when the run has no moe_load rows with an `expert_load` column."""
    rows: dict[tuple[int, str], tuple[int, list[int]]] = {}  # (vpp_stage, name) -> (step, load)
    order: list[tuple[int, str]] = []
    for f in source.select(families=[FAMILY], steps=steps):
        for vpp, name, step, load in _read(f.path, source.kind):
            if load is None or (steps is not None and not steps[0] <= step <= steps[1]):
                continue
            key = (vpp, name)
            if key not in rows:
                order.append(key)
            if key not in rows or step >= rows[key][0]:
                rows[key] = (step, load)
    if not rows:
        return None
    last = max(step for step, _ in rows.values())
    keep = [k for k in order if rows[k][0] == last]
    multi = len({vpp for vpp, _ in keep}) > 1
    index = [f"{vpp}:{name}" if multi else name for vpp, name in keep]
    width = max(len(rows[k][1]) for k in keep)
    data = [rows[k][1] + [float("nan")] * (width - len(rows[k][1])) for k in keep]
    df = pd.DataFrame(data, index=index, columns=list(range(width)), dtype=float)
    df.index.name, df.columns.name = "layer", "expert"
    df.attrs["step"] = last
    return df


def _read(path: str, kind: str) -> list[tuple[int, str, int, Any]]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        if "expert_load" not in schema.names:
            return []
        table = pq.read_table(path, columns=["vpp_stage", "name", "step", "expert_load"]).to_pydict()
        return list(zip(table["vpp_stage"], table["name"], table["step"], table["expert_load"]))
    out = []
    with open(path, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            text = r.get("expert_load")
            load = json.loads(text) if text else None
            out.append((int(r.get("vpp_stage") or 0), r["name"], int(r["step"]), load))
    return out
