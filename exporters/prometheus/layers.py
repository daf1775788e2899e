"""The per-layer (and, with `per_parameter`, per-tensor) gauges of one collected step's rows, set by the
Prometheus sink (`self`) on the worker thread under its lock."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainermon.collect.family_columns import EXTRA_COLUMNS
from trainermon.collect.records import XRANK_FAMILIES, StatBatch
from trainermon.stats.table import combine

from .metrics import layer_of


def aggregate(groups: np.ndarray, count: int, values: dict[str, np.ndarray], stats: tuple[str, ...]) -> dict:
    """Rows combined into `count` groups by the statistics table's rules (`stats.table.combine`)."""
    return combine(groups, count, values, stats)


def update_stats(self: Any, batch: StatBatch, gauges: bool = True) -> None:
    """The step's non-finite count, and (`gauges`) its layer/parameter gauges."""
    rows = batch.rows
    # A None element of a module's output gets msprobe's NaN row (no tensor: numel 0, no dtype); it
    # holds no NaN, so it neither counts as a non-finite step nor turns its layer's norm into NaN.
    real = np.array([r.numel > 0 or r.dtype is not None for r in rows], dtype=bool)
    keep = [
        i
        for i, r in enumerate(rows)
        if real[i]
        and (self.families is None or r.family in self.families)
        and (self.all_per_rank or r.family not in XRANK_FAMILIES or self._is_target(r.name))
    ]
    values = batch.values
    nonfinite = any(stat in values and np.any(values[stat] > 0) for stat in ("nans", "infs"))
    if "norm" in values and not np.all(np.isfinite(np.asarray(values["norm"])[real])):
        nonfinite = True
    # A step the loss scaler skipped for its overflow is the scaler at work (trainermon_skipped_steps)
    if nonfinite and not batch.scalars.scaler_skip:
        self.m.nonfinite.labels(self.rank).inc()
    if not keep or not gauges:
        return
    idx = np.asarray(keep, dtype=np.int64)
    sub = {k: np.asarray(v)[idx] for k, v in values.items()}
    sub_rows = [rows[i] for i in keep]
    export_groups(self, self.m.layer, sub_rows, sub, per_parameter=False)
    if self.m.param is not None:
        export_groups(self, self.m.param, sub_rows, sub, per_parameter=True)


def export_groups(self: Any, metric: Any, rows: list, values: dict, per_parameter: bool) -> None:
    index: dict[tuple, int] = {}
    labels: list[tuple] = []
    groups = np.empty(len(rows), dtype=np.int64)
    cache = self._group_cache
    for i, r in enumerate(rows):
        ck = (r.family, r.vpp_stage, r.name)
        hit = cache.get(ck)
        if hit is None:
            shown = f"{r.vpp_stage}:{r.name}" if r.vpp_stage else r.name
            # comm rows: one series per op, group and input/output (call sites summed)
            layer = r.name.partition("@")[0] if r.family == "comm" else layer_of(r.name, r.vpp_stage)
            hit = cache[ck] = (layer, shown)
        layer, shown = hit
        key = (r.family, layer, shown) if per_parameter else (r.family, layer)
        g = index.get(key)
        if g is None:
            g = index[key] = len(labels)
            labels.append(key)
        groups[i] = g
    stats = tuple(s for s in self.stats if s in values)
    combined = aggregate(groups, len(labels), values, stats)
    for extra in _FAMILY_GAUGES:  # update: ratio; moe_load: load_cv, dropped, aux_loss
        if extra in values:  # a layer shows the largest value of its rows
            combined[extra] = _max_by_group(groups, len(labels), values[extra])
            stats += (extra,)
    dropped = 0
    for stat in stats:
        column = combined[stat]
        for g, key in enumerate(labels):
            if stat in _FAMILY_GAUGES and (key[0] not in _FAMILY_GAUGES[stat] or np.isnan(column[g])):
                continue  # another family's row, or a value the router does not report
            child = self._child(metric, (self.rank, *key, stat))
            if child is None:
                dropped += 1
                continue
            child.set(float(column[g]))
    self._count_dropped(dropped)


#: Float columns of single families exported as gauges (stat label = the column), by family.
_FAMILY_GAUGES = {name: families for name, kind, families in EXTRA_COLUMNS if kind == "float"}


def _max_by_group(groups: np.ndarray, count: int, values: np.ndarray) -> np.ndarray:
    """The largest non-NaN value of each group (NaN where a group has none)."""
    out = np.full(count, -np.inf)
    np.fmax.at(out, groups, np.asarray(values, dtype=np.float64))
    return np.where(np.isneginf(out), np.nan, out)
