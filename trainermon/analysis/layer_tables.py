"""Per-layer vectors of the last step, offline: a family's list column as a layer x index table of the
last step the run has (in the step range asked for), read from Parquet or CSV.

- `moe_load.expert_load`: tokens routed to each expert (router x expert);
- `attn_logit.head_max_logit`: each head's largest pre-softmax logit (attention layer x head).
"""

from __future__ import annotations

import csv
import json
from typing import Any

import pandas as pd

from .source import RunSource


def expert_load_last_step(source: RunSource, steps: tuple[int, int] | None = None) -> pd.DataFrame | None:
    """Routers (rows, model order) x experts (columns) of tokens routed at the last step with rows; None
    when the run has no moe_load rows with an `expert_load` column."""
    return last_step_table(source, "moe_load", "expert_load", "expert", steps)


def head_logits_last_step(source: RunSource, steps: tuple[int, int] | None = None) -> pd.DataFrame | None:
    """Attention layers x heads (global indices) of the largest logit at the last step with rows; None
    when the run has no attn_logit rows with a `head_max_logit` column."""
    return last_step_table(source, "attn_logit", "head_max_logit", "head", steps)


def last_step_table(
    source: RunSource, family: str, column: str, axis: str, steps: tuple[int, int] | None = None
) -> pd.DataFrame | None:
    rows: dict[tuple[int, str], tuple[int, list]] = {}  # (vpp_stage, name) -> (step, vector)
    order: list[tuple[int, str]] = []
    for f in source.select(families=[family], steps=steps):
        for vpp, name, step, vector in _read(f.path, source.kind, column):
            if vector is None or (steps is not None and not steps[0] <= step <= steps[1]):
                continue
            key = (vpp, name)
            if key not in rows:
                order.append(key)
            if key not in rows or step >= rows[key][0]:
                rows[key] = (step, list(vector))
    if not rows:
        return None
    last = max(step for step, _ in rows.values())
    keep = [k for k in order if rows[k][0] == last]
    multi = len({vpp for vpp, _ in keep}) > 1
    index = [f"{vpp}:{name}" if multi else name for vpp, name in keep]
    width = max(len(rows[k][1]) for k in keep)
    data = [rows[k][1] + [float("nan")] * (width - len(rows[k][1])) for k in keep]
    df = pd.DataFrame(data, index=index, columns=list(range(width)), dtype=float)
    df.index.name, df.columns.name = "layer", axis
    df.attrs["step"] = last
    return df


def _read(path: str, kind: str, column: str) -> list[tuple[int, str, int, Any]]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        if column not in schema.names:
            return []
        table = pq.read_table(path, columns=["vpp_stage", "name", "step", column]).to_pydict()
        return list(zip(table["vpp_stage"], table["name"], table["step"], table[column]))
    out = []
    with open(path, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            text = r.get(column)
            vector = json.loads(text) if text else None
            out.append((int(r.get("vpp_stage") or 0), r["name"], int(r["step"]), vector))
    return out
