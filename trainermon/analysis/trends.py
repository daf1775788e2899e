"""Views of a scanned run: layer x step matrices, the global gradient norm, spikes, growth, first NaN/Inf.

Every function takes a `RunSummary` (from `scan`) and returns a pandas object. Layers are in model
order (see `CellGrid.order`); a column is a step, with micro-steps merged (cells combine rows across
ranks and micro-steps as `grid.py` describes).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from trainermon.pipeline.spike_window import SpikeWindow

from .scan import RunSummary
from .source import family_order


def _grid(summary: RunSummary, family: str):
    grid = summary.grids.get(family)
    if grid is None:
        raise KeyError(f"family {family!r} was not scanned (scanned: {summary.families})")
    return grid


def heatmap(summary: RunSummary, family: str, stat: str = "norm") -> pd.DataFrame:
    """Layers (model order) x steps of one statistic; NaN where a layer has no row at a step."""
    grid = _grid(summary, family)
    final = grid.finalize("step")
    if stat not in final.values:
        raise KeyError(f"{family}: no {stat!r} values (statistics seen: {sorted(final.values)})")
    df = pd.DataFrame(final.values[stat], index=final.labels, columns=final.keys)
    df.index.name, df.columns.name = "layer", "step"
    return df


def nonfinite_cells(summary: RunSummary, family: str) -> pd.DataFrame:
    """Bool layers x steps: a NaN or Inf statistic, or a non-zero NaN/Inf count, in that cell."""
    final = _grid(summary, family).finalize("step")
    return pd.DataFrame(final.nonfinite, index=final.labels, columns=final.keys)


def available_stats(summary: RunSummary, family: str) -> list[str]:
    return [s for s in _grid(summary, family).stats if s in _grid(summary, family).seen_stats]


def global_grad_norm(summary: RunSummary, family: str = "grad_reduced") -> pd.Series:
    """sqrt(sum over tensors of norm^2) per step, over the `grad_reduced` rows of every rank.

    trainermon writes a replicated or sharded reduced gradient once per data-parallel group, as exact
    full-parameter statistics; what is left on several ranks is either a disjoint piece (tensor or
    pipeline parallelism: different tensors, or shards of one) or a copy (msprobe's output, which
    repeats replicated tensors on every rank). Cells combine pieces and count copies once (`grid.py`),
    so the sum over cells is the norm of the whole model's gradient. A NaN or Inf anywhere at a step
    (a statistic, or a non-zero nans/infs count) makes that step's norm NaN. Empty when the run has no
    `grad_reduced` norms.
    """
    grid = summary.grids.get(family)
    if grid is None or "norm" not in grid.seen_stats:
        return pd.Series([], dtype=np.float64, name="global_grad_norm").rename_axis("step")
    final = grid.finalize("step")
    norms, here = final.values["norm"], final.present["norm"]
    squares = np.where(here, norms * norms, 0.0)
    any_row = here.any(axis=0)
    total = np.sqrt(squares.sum(axis=0))
    # With nans/infs collected a tensor's norm covers its finite elements only; the global norm of a
    # step with any NaN or Inf is NaN all the same (as torch's clip_grad_norm_ would report it).
    total = np.where(final.nonfinite.any(axis=0), np.nan, total)
    series = pd.Series(total[any_row], index=final.keys[any_row], name="global_grad_norm")
    series.index.name = "step"
    return series


def find_spikes(
    series: pd.Series, window: int = 50, warmup: int = 10, z: float = 6.0, min_rel: float = 0.1
) -> pd.DataFrame:
    """Steps whose value is a spike: log(value) more than `z` robust deviations (1.4826 x the median
    absolute deviation, at least log(1 + min_rel)) above the trend of the last `window` values, once
    `warmup` values are there: the online `AnomalySpike` rule's own test (`SpikeWindow`, which says how
    the trend is taken out). Non-finite and non-positive values are skipped."""
    history = SpikeWindow(window)
    rows = []
    for step, value in series.items():
        value = float(value)
        baseline = history.check_then_add(value, max(2, warmup), z, min_rel)
        if baseline is not None:
            rows.append({"step": int(step), "value": value, "baseline": baseline, "ratio": value / baseline})
    return pd.DataFrame(rows, columns=["step", "value", "baseline", "ratio"])


def growth(
    summary: RunSummary, family: str, stat: str = "norm", top: int | None = 10, edge: float = 0.05
) -> pd.DataFrame:
    """Layers ranked by how much `stat` grew over the run.

    start / end: the median of the first / last `edge` fraction of a layer's finite values (at least one
    value; cells whose tensor held NaN/Inf are left out); growth = end / start; peak and its step;
    first_step_2x: the first step where the value was
    more than twice `start`. Sorted by growth, largest first (layers without a positive start last).
    """
    df = heatmap(summary, family, stat)
    steps = df.columns.to_numpy()
    # a cell whose tensor held NaN/Inf: its statistics cover the finite elements only (an all-NaN
    # tensor's norm is 0), so it is no value of the trend
    flagged = nonfinite_cells(summary, family).reindex(index=df.index, columns=df.columns).to_numpy()
    out = []
    for label, row, bad in zip(df.index, df.to_numpy(), flagged):
        finite = np.isfinite(row) & ~bad.astype(bool)
        vals, at = row[finite], steps[finite]
        if vals.size == 0:
            continue
        k = max(1, int(vals.size * edge))
        start, end = float(np.median(vals[:k])), float(np.median(vals[-k:]))
        ratio = end / start if start > 0 else math.nan
        peak_i = int(np.argmax(vals))
        over = np.flatnonzero(vals > 2 * start) if start > 0 else np.array([], dtype=np.int64)
        out.append(
            {
                "layer": label,
                "start": start,
                "end": end,
                "growth": ratio,
                "peak": float(vals[peak_i]),
                "peak_step": int(at[peak_i]),
                "first_step_2x": int(at[over[0]]) if over.size else None,
            }
        )
    result = pd.DataFrame(
        out, columns=["layer", "start", "end", "growth", "peak", "peak_step", "first_step_2x"]
    )
    result = result.sort_values("growth", ascending=False, na_position="last", kind="stable")
    result = result.reset_index(drop=True)
    return result if top is None else result.head(top)


def first_nonfinite(summary: RunSummary) -> pd.DataFrame:
    """Rows with a NaN or Inf (a statistic, or a non-zero nans/infs count), in the order they happened.

    Kept per family: the rows at that family's first step with any. Ordered by step, micro-step (rows
    without one, such as optimizer state, after every micro-batch), family (the order hooks run within
    a step: actv, actv_grad, grad_unreduced, grad_reduced, param_origin, exp_avg, exp_avg_sq,
    param_updated), model order, rank. The first row is the first tensor with a NaN or Inf.
    """
    rows = []
    for family, kept in summary.nonfinite_rows.items():
        grid = summary.grids[family]
        position = np.empty(len(grid.tensors), dtype=np.int64)
        position[grid.order()] = np.arange(len(grid.tensors))
        for r in kept:
            idx = grid.tensors.index.get((r["vpp_stage"], r["name"]))
            rows.append({**r, "_pos": int(position[idx]) if idx is not None else 1 << 40})
    if not rows:
        return pd.DataFrame(columns=["step", "micro_step", "family", "vpp_stage", "name", "rank"])
    df = pd.DataFrame(rows)
    df["_micro"] = df["micro_step"].map(lambda m: math.inf if m is None or pd.isna(m) else m)
    df["_fam"] = df["family"].map(family_order)
    df = df.sort_values(["step", "_micro", "_fam", "family", "_pos", "rank"], kind="stable")
    lead = ["step", "micro_step", "family", "vpp_stage", "name", "rank"]
    rest = [c for c in df.columns if c not in lead and not c.startswith("_")]
    return df[lead + rest].reset_index(drop=True)


def downsample(df: pd.DataFrame, max_columns: int, how: str = "max") -> tuple[pd.DataFrame, int]:
    """At most `max_columns` columns: consecutive steps binned. `how`: "max", "min" or "mean" of each
    bin's values (NaN ignored unless the whole bin is NaN), or "any" for a bool frame. Returns (frame,
    steps per bin); a bin is labelled with its first step. NaN/Inf cells are best marked from
    `nonfinite_cells` downsampled with "any"."""
    n = df.shape[1]
    if n <= max_columns or max_columns <= 0:
        return df, 1
    width = math.ceil(n / max_columns)
    data = df.to_numpy()
    starts = np.arange(0, n, width)
    if how == "any":
        binned = np.logical_or.reduceat(data.astype(bool), starts, axis=1)
    else:
        data = data.astype(np.float64)
        finite_or_inf = ~np.isnan(data)
        with np.errstate(invalid="ignore", divide="ignore"):
            if how == "min":
                binned = np.fmin.reduceat(data, starts, axis=1)
            elif how == "mean":
                sums = np.add.reduceat(np.where(finite_or_inf, data, 0.0), starts, axis=1)
                counts = np.add.reduceat(finite_or_inf.astype(np.float64), starts, axis=1)
                binned = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
            elif how == "max":
                binned = np.fmax.reduceat(data, starts, axis=1)
            else:
                raise ValueError(f"how: got {how!r}; allowed: max, min, mean, any")
    out = pd.DataFrame(binned, index=df.index, columns=df.columns[starts])
    out.columns.name = df.columns.name
    return out, width
