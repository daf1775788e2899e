"""JSON-ready conversions shared by the findings of `analyze` and `compare`."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pandas as pd


def jsonable(value: Any) -> Any:
    """Numpy scalars to Python; non-finite floats as "nan", "inf", "-inf"."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def _is_int_column(name: str) -> bool:
    # first_step_2x: a step (pandas makes the column float when a layer has None)
    return name.endswith(("step", "step_2x")) or name in ("rank", "vpp_stage", "layers", "steps")


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def records(df: pd.DataFrame) -> list[dict]:
    """Rows as dicts. Step-like columns (integers that may be missing): int or None. Other numbers:
    floats, with NaN and Inf spelled "nan", "inf", "-inf" (JSON has no such numbers). A missing value of
    a text column (pandas holds None there as float NaN) is None."""
    out = []
    text = {k for k in df.columns if pd.api.types.is_string_dtype(df[k])}  # (object: only all-text ones)
    for row in df.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if _is_int_column(str(key)) and isinstance(value, (float, np.floating)):
                value = None if math.isnan(value) else int(value)
            elif value is None or value is pd.NA or (key in text and _is_nan(value)):
                value = None
            clean[key] = jsonable(value)
        out.append(clean)
    return out


def describe(summary: Any) -> dict:
    """What was read: path, detected kind, families, ranks, rows, time, notes."""
    src = summary.source
    ranks, families = src.ranks(), summary.families
    wanted = getattr(summary, "ranks", None)
    if wanted is not None:  # `--ranks`: describe what was read, not the whole run
        ranks = [r for r in ranks if r in set(wanted)]
        families = [f for f in families if set(src.ranks(f)) & set(ranks)]
    return {
        "path": src.path if "://" in str(src.path) else os.path.abspath(src.path),  # a URL as given
        "kind": src.kind,
        "families": families,
        "ranks": ranks,
        "rows_read": summary.rows_read,
        "seconds": round(summary.seconds, 3),
        "notes": summary.notes,
    }
