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
    return name.endswith("step") or name in ("rank", "vpp_stage", "layers", "steps")


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
    return {
        "path": src.path if "://" in str(src.path) else os.path.abspath(src.path),  # a URL as given
        "kind": src.kind,
        "families": summary.families,
        "ranks": src.ranks(),
        "rows_read": summary.rows_read,
        "seconds": round(summary.seconds, 3),
        "notes": summary.notes,
    }
