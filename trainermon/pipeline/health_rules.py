"""Anomaly rules of the training-health families (called by `AnomalyDetector`, worker thread only).

- `AnomalyUpdateRatio`: an `update` row's ||dw||/||w|| above `threshold` (when given), or a spike of it
  as `AnomalySpike` defines one (`window`, `warmup`, `z`, `min_rel`), per parameter. A non-finite ratio
  is not one (inf: the parameter was all zeros before the step).
- `AnomalyExpertCollapse`: a `moe_load` row whose coefficient of variation of the per-expert load is above
  `cv` (default 1.0: the spread of the load is as large as its mean), or whose fraction of experts that got
  no token is above `dead` (when given). The record names the statistic (`load_cv` or `zeros`).
- `AnomalyLogitGrowth`: an `attn_logit` row (one attention layer) whose largest pre-softmax logit `max`
  is above `threshold` (default 100), or above `growth` times the layer's first collected value (when
  `growth` is given and that value is positive). One record per row and step (the threshold's first);
  the baseline is the limit crossed.
"""

from __future__ import annotations

import math
from typing import Any

from trainermon.collect.records import StatBatch

from .rule_specs import WARMUP, WINDOW


def update_ratio(det: Any, batch: StatBatch, args: dict, now: float) -> list:
    column = batch.values.get("ratio")
    if column is None:
        return []
    limit = args.get("threshold")
    window, warmup = int(args.get("window", WINDOW)), max(2, int(args.get("warmup", WARMUP)))
    z, min_rel = float(args.get("z", 6.0)), float(args.get("min_rel", 0.1))
    out = []
    for i, row in enumerate(batch.rows):
        value = float(column[i])
        # inf: the parameter was all zeros before the step (a zero-initialised bias at its first update),
        # where the ratio means nothing; a non-finite update is AnomalyNan's, as in the other rules.
        if row.family != "update" or not math.isfinite(value):
            continue
        roll = det.roll(window, "ratio", row.vpp_stage, row.name)
        baseline = roll.check_then_add(value, warmup, z, min_rel)
        if limit is not None and value > float(limit):
            baseline = float(limit)
        if baseline is not None:
            out.append(det._make(batch, i, "ratio", value, baseline, "AnomalyUpdateRatio", now))
    return out


def expert_collapse(det: Any, batch: StatBatch, args: dict, now: float) -> list:
    cv_limit = float(args.get("cv", 1.0))
    dead = args.get("dead")
    cvs, zeros = batch.values.get("load_cv"), batch.values.get("zeros")
    out = []
    for i, row in enumerate(batch.rows):
        if row.family != "moe_load":
            continue
        if cvs is not None and float(cvs[i]) > cv_limit:
            out.append(det._make(batch, i, "load_cv", float(cvs[i]), cv_limit, "AnomalyExpertCollapse", now))
        if dead is not None and zeros is not None and float(zeros[i]) > float(dead):
            out.append(
                det._make(batch, i, "zeros", float(zeros[i]), float(dead), "AnomalyExpertCollapse", now)
            )
    return out


def logit_growth(det: Any, batch: StatBatch, args: dict, now: float) -> list:
    column = batch.values.get("max")
    if column is None:
        return []
    limit = float(args.get("threshold", 100.0))
    growth = args.get("growth")
    out = []
    for i, row in enumerate(batch.rows):
        value = float(column[i])
        if row.family != "attn_logit" or math.isnan(value):
            continue
        first = det.roll(1, "attn_first", row.vpp_stage, row.name).values
        if not first:
            first.append(value)  # kept with the detector's state, like the rolling windows
        baseline = None
        if value > limit:
            baseline = limit
        elif growth is not None and first[0] > 0 and value > float(growth) * first[0]:
            baseline = float(growth) * first[0]
        if baseline is not None:
            out.append(det._make(batch, i, "max", value, baseline, "AnomalyLogitGrowth", now))
    return out
