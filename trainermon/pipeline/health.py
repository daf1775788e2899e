"""Worker-side halves of the training-health families: rows the probes add as hidden families, merged
across ranks like any other row, become the user-facing rows here (after the merge, before finalising).

- `update` (runtime/probes/update.py): ratio = ||dw|| / ||w_before|| from the merged sums of squares of
  the update row and its hidden `_update_base` row.
- `moe_load` (runtime/probes/moe.py): a router's hidden `_moe` rows (one per expert, `micro_step` = the
  expert index, whose merged `sum` is the global token count; `MOE_DROPPED`, `MOE_AUX`) become one row
  per router: norm/mean/min/max/zeros of the per-expert load vector (zeros: the fraction of experts that
  got no token), and `load_cv` (std/mean), `max_expert`, `min_expert` (lowest index on ties), `dropped`,
  `aux_loss` (NaN where the router does not report it) and `expert_load` (the vector).
- `attn_logit` (runtime/probes/attn.py): a layer's hidden `_attn` rows (one per global head,
  `micro_step` = the head, whose merged `max` / `min` are the head's largest / smallest logit over every
  rank) become one row per layer: max (the largest logit of any head), min (the smallest of any head),
  mean and norm of the per-head maxima, `max_head` (lowest index on ties) and `head_max_logit` (the
  per-head maxima, NaN for a head without a visible logit).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainermon.collect.family_columns import FAMILY_COLUMNS
from trainermon.stats import MAX, MIN, NANS, SUM, SUMSQ

UPDATE_FAMILY, UPDATE_BASE = "update", "_update_base"
MOE_FAMILY, MOE_HIDDEN = "moe_load", "_moe"
MOE_DROPPED, MOE_AUX = -1, -2  # micro_step of a router's dropped-token and aux-loss rows
ATTN_FAMILY, ATTN_HIDDEN = "attn_logit", "_attn"


def update_ratio(rows: tuple, partials: np.ndarray) -> tuple[tuple, np.ndarray, np.ndarray | None]:
    """Pair each `update` row with its hidden `_update_base` row (same vpp_stage and name: the same
    parameter, merged over the same shards) and form ||dw|| / ||w_before|| from the merged sums of
    squares; drop the hidden rows. Returns (rows, partials, ratio column or None when the step has no
    update rows; NaN on rows of other families and where the base row is missing)."""
    base = {(r.vpp_stage, r.name): i for i, r in enumerate(rows) if r.family == UPDATE_BASE}
    if not base:
        return rows, partials, None
    keep = [i for i, r in enumerate(rows) if r.family != UPDATE_BASE]
    ratio = np.full(len(keep), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        for out, i in enumerate(keep):
            r = rows[i]
            j = base.get((r.vpp_stage, r.name)) if r.family == UPDATE_FAMILY else None
            if j is not None:
                # sqrt(a) / sqrt(b): an all-zero weight gives inf (or NaN for a zero update), not 0
                ratio[out] = np.sqrt(max(partials[i, SUMSQ], 0.0)) / np.sqrt(max(partials[j, SUMSQ], 0.0))
    return tuple(rows[i] for i in keep), partials[keep], ratio


def moe_load(rows: tuple, partials: np.ndarray) -> tuple[tuple, np.ndarray, Callable | None]:
    """Take the hidden `_moe` rows out; return (rows, partials, a function that appends one `moe_load`
    row per router to the finalised (rows, values), or None when the step has none)."""
    hidden = [i for i, r in enumerate(rows) if r.family == MOE_HIDDEN]
    if not hidden:
        return rows, partials, None
    routers: dict[tuple[int, str], dict[int, float]] = {}
    unknown = set()  # routers whose counts some rank could not read (NaN rows, `runtime/probes/moe.py`)
    for i in hidden:
        r = rows[i]
        routers.setdefault((r.vpp_stage, r.name), {})[r.micro_step] = float(partials[i, SUM])
        if r.micro_step >= 0 and (partials[i, NANS] > 0 or not np.isfinite(partials[i, SUM])):
            unknown.add((r.vpp_stage, r.name))
    out = set(hidden)
    keep = [i for i in range(len(rows)) if i not in out]

    def append(kept: tuple, values: dict[str, np.ndarray]) -> tuple[tuple, dict[str, np.ndarray]]:
        import torch

        from trainermon.collect.records import RowMeta

        new_rows, extra = [], {name: [] for name, _ in FAMILY_COLUMNS[MOE_FAMILY]}
        stats = {k: [] for k in ("norm", "mean", "min", "max", "zeros", "nans", "infs", "numel")}
        for (vpp, name), got in routers.items():
            experts = sorted(k for k in got if k >= 0)
            if experts != list(range(len(experts))) or not experts or (vpp, name) in unknown:
                continue  # an expert row a rank could not compute: no row rather than a wrong one
            load = np.array([got[e] for e in experts])
            mean = float(load.mean())
            new_rows.append(RowMeta(MOE_FAMILY, vpp, name, None, (len(load),), torch.int64, len(load)))
            for key, value in (
                ("norm", float(np.sqrt((load * load).sum()))),
                ("mean", mean),
                ("min", float(load.min())),
                ("max", float(load.max())),
                ("zeros", float((load == 0).mean())),
                ("nans", 0.0),
                ("infs", 0.0),
                ("numel", float(len(load))),
            ):
                stats[key].append(value)
            extra["load_cv"].append(float(load.std()) / mean if mean > 0 else np.nan)
            extra["max_expert"].append(float(np.argmax(load)))
            extra["min_expert"].append(float(np.argmin(load)))
            extra["dropped"].append(got.get(MOE_DROPPED, np.nan))
            extra["aux_loss"].append(got.get(MOE_AUX, np.nan))
            extra["expert_load"].append([int(round(v)) for v in load])
        return _append(kept, values, new_rows, stats, extra, MOE_FAMILY)

    return tuple(rows[i] for i in keep), partials[keep], append


def _append(kept: tuple, values: dict, new_rows: list, stats: dict, extra: dict, family: str) -> tuple:
    """The finalised (rows, values) with `new_rows` of `family` appended: their statistics from `stats`,
    their family columns from `extra`, NaN / None for the other rows."""
    if not new_rows:
        return kept, values
    n_old, n_new = len(kept), len(new_rows)
    merged = {}
    for key, column in values.items():
        tail = stats.get(key)
        merged[key] = np.concatenate([column, np.asarray(tail if tail else [np.nan] * n_new, dtype=float)])
    for key, kind in FAMILY_COLUMNS[family]:
        if kind in ("list", "flist"):
            column = np.empty(n_old + n_new, dtype=object)
            column[n_old:] = extra[key]
        else:
            column = np.concatenate([np.full(n_old, np.nan), np.asarray(extra[key], dtype=float)])
        if key in merged and kind not in ("list", "flist"):  # another family's column of the same name
            column[:n_old] = merged[key][:n_old]
        merged[key] = column
    return tuple(kept) + tuple(new_rows), merged


def attn_logit(rows: tuple, partials: np.ndarray) -> tuple[tuple, np.ndarray, Callable | None]:
    """Take the hidden `_attn` rows out; return (rows, partials, a function that appends one `attn_logit`
    row per attention layer to the finalised (rows, values), or None when the step has none)."""
    hidden = [i for i, r in enumerate(rows) if r.family == ATTN_HIDDEN]
    if not hidden:
        return rows, partials, None
    layers: dict[tuple[int, str], dict[int, tuple[float, float]]] = {}
    for i in hidden:
        r = rows[i]
        layers.setdefault((r.vpp_stage, r.name), {})[r.micro_step] = (partials[i, MAX], partials[i, MIN])
    out = set(hidden)
    keep = [i for i in range(len(rows)) if i not in out]

    def append(kept: tuple, values: dict[str, np.ndarray]) -> tuple[tuple, dict[str, np.ndarray]]:
        import torch

        from trainermon.collect.records import RowMeta

        new_rows, extra = [], {name: [] for name, _ in FAMILY_COLUMNS[ATTN_FAMILY]}
        stats = {k: [] for k in ("norm", "mean", "min", "max", "zeros", "nans", "infs", "numel")}
        for (vpp, name), got in layers.items():
            heads = sorted(got)
            if heads != list(range(len(heads))):
                continue  # a head row a rank could not compute: no row rather than a wrong one
            top = np.array([got[h][0] for h in heads], dtype=float)
            low = np.array([got[h][1] for h in heads], dtype=float)
            top[~np.isfinite(top)] = np.nan  # no visible logit (or no rank ran the layer)
            low[~np.isfinite(low)] = np.nan
            if np.isnan(top).all():
                continue
            new_rows.append(RowMeta(ATTN_FAMILY, vpp, name, None, (len(top),), torch.float32, len(top)))
            seen = top[~np.isnan(top)]
            for key, value in (
                ("norm", float(np.sqrt((seen * seen).sum()))),
                ("mean", float(seen.mean())),
                ("min", float(np.nanmin(low))),
                ("max", float(seen.max())),
                ("zeros", 0.0),
                ("nans", float(np.isnan(top).sum())),
                ("infs", 0.0),
                ("numel", float(len(top))),
            ):
                stats[key].append(value)
            extra["max_head"].append(float(np.nanargmax(top)))
            extra["head_max_logit"].append([float(v) for v in top])
        return _append(kept, values, new_rows, stats, extra, ATTN_FAMILY)

    return tuple(rows[i] for i in keep), partials[keep], append
