"""From a submitted step to the batch exporters see: finalise the partials, derive the step's values
(global gradient norm, loss scale), and run the anomaly rules. Runs on the worker thread only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from trainermon.collect.records import Derived, StatBatch, StepPayload
from trainermon.failsafe import FaultLog
from trainermon.stats import NANS, SUMSQ, finalize

from .anomaly import AnomalyDetector

UPDATE_FAMILY, UPDATE_BASE = "update", "_update_base"  # see runtime/probes/update.py


class Deriver:
    """`deriver(payload) -> StatBatch`. `dropped` reports the worker's cumulative dropped-row count."""

    def __init__(self, faults: FaultLog, detector: AnomalyDetector | None = None) -> None:
        self.faults = faults
        self.detector = detector
        self.dropped: Callable[[], int] = lambda: 0

    def __call__(self, payload: StepPayload) -> StatBatch:
        if payload.ready is not None:
            payload.ready.synchronize()
        partials = payload.partials.numpy()
        rows = payload.rows
        dropped = np.isnan(partials[:, NANS])  # rows a rank could not compute (StepCollector.finish)
        if dropped.any():
            keep = np.flatnonzero(~dropped)
            partials = partials[keep]
            rows = tuple(rows[i] for i in keep)
        rows, partials, ratio = update_ratio(rows, partials)
        numel = np.fromiter((r.numel for r in rows), dtype=np.float64, count=len(rows))
        values = finalize(partials, numel)
        if ratio is not None:
            values["ratio"] = ratio
        # Global gradient norm from the per-parameter sums of squares (exact across shards, since each
        # written row is already the full parameter's merged statistic).
        reduced = [i for i, r in enumerate(rows) if r.family == "grad_reduced"]
        norm = float(np.sqrt(np.sum(partials[reduced, SUMSQ]))) if reduced else None
        if payload.job_grad_sumsq is not None:  # a model split over ranks: every rank's written rows
            norm = float(np.sqrt(max(float(payload.job_grad_sumsq), 0.0)))
        scale = payload.scalars.loss_scale
        derived = Derived(
            global_grad_norm=norm,
            loss_scale=None if scale is None else float(scale),
            dropped_rows=self.dropped(),
            monitor_faults=self.faults.total,
        )
        batch = StatBatch(payload.step, rows, values, payload.scalars, derived)
        if self.detector is not None:
            self.detector.check(batch)
            batch = replace(batch, derived=replace(derived, anomalies_total=self.detector.totals()))
        return batch


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
