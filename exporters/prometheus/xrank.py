"""Cross-rank summaries on the Prometheus endpoint of the rank that writes them (rank 0), per layer.

    trainermon_xrank_stat{family, layer, stat, agg}   agg: max, max_rank, min, min_rank
    trainermon_xrank_nonfinite{family, layer, agg}    agg: count (NaN + Inf, all ranks), first_rank

A layer's value is the extreme over its tensors (and micro-batches) of the per-rank extremes, with the
rank that holds it; `first_rank` is the lowest rank with a non-finite value in the layer (-1: none). So
one rank's endpoint answers "which rank, which layer" for the whole job with a few series per layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .metrics import layer_of


def export(exporter: Any, table: Any) -> int:
    """Set the gauges from an `XRankTable`; returns the series left out by the budget."""
    m = exporter.m
    groups: dict[tuple, list[int]] = {}
    for i, (family, vpp_stage, name, _micro, stat) in enumerate(table.rows):
        groups.setdefault((family, layer_of(name, vpp_stage), stat), []).append(i)
    v = table.values
    dropped = 0
    nonfinite: dict[tuple, tuple[int, int]] = {}
    first_stat = table.rows[0][4] if table.rows else None
    for (family, layer, stat), rows in groups.items():
        idx = np.asarray(rows, dtype=np.int64)
        out: dict[str, float] = {}
        for agg, pick in (("max", np.nanargmax), ("min", np.nanargmin)):
            column = v[agg][idx]
            if np.all(np.isnan(column)):
                out[agg], out[f"{agg}_rank"] = float("nan"), -1.0
                continue
            best = int(pick(column))
            out[agg], out[f"{agg}_rank"] = float(column[best]), float(v[f"{agg}_rank"][idx][best])
        for agg, value in out.items():
            child = exporter._child(m.xrank, (exporter.rank, family, layer, stat, agg))
            if child is None:
                dropped += 1
            else:
                child.set(value)
        if stat == first_stat:  # counts repeat for every statistic of a row: take them once
            bad = v["nonfinite_rank"][idx]
            first = int(bad[bad >= 0].min()) if np.any(bad >= 0) else -1
            nonfinite[(family, layer)] = (int(v["nans"][idx].sum() + v["infs"][idx].sum()), first)
    for (family, layer), (count, first) in nonfinite.items():
        for agg, value in (("count", count), ("first_rank", first)):
            child = exporter._child(m.xrank_nonfinite, (exporter.rank, family, layer, agg))
            if child is None:
                dropped += 1
            else:
                child.set(value)
    return dropped
