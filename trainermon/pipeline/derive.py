"""From a submitted step to the batch exporters see: finalise the partials, derive the step's values
(global gradient norm, loss scale), and run the anomaly rules. Runs on the worker thread only."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from itertools import compress
from operator import attrgetter

import numpy as np

from trainermon.collect.records import Derived, StatBatch, StepPayload
from trainermon.failsafe import FaultLog
from trainermon.stats import NANS, finalize, grad_sumsq

from .anomaly import AnomalyDetector
from .health import (
    ATTN_HIDDEN,
    MOE_HIDDEN,
    UPDATE_BASE,
    UPDATE_FAMILY,  # noqa: F401 - re-exported
    attn_logit,
    moe_load,
    update_ratio,
)

_FAMILY, _NUMEL = attrgetter("family"), attrgetter("numel")
logger = logging.getLogger("trainermon")


class Deriver:
    """`deriver(payload) -> StatBatch`. `dropped` reports the worker's cumulative dropped-row count."""

    def __init__(self, faults: FaultLog, detector: AnomalyDetector | None = None) -> None:
        self.faults = faults
        self.detector = detector
        self.dropped: Callable[[], int] = lambda: 0
        self._told: set[frozenset[str]] = set()  # sets of unread gradients told of (`_tell_unread`)

    def _tell_unread(self, names: tuple[str, ...]) -> None:
        """One warning per set of gradients the global norm could not count (the worker thread only)."""
        key = frozenset(names)
        if key in self._told or len(self._told) >= 100:
            return
        self._told.add(key)
        logger.warning(
            "trainermon: global_grad_norm is NaN: the gradients of %s could not be read (see the "
            "unreadable tensor lines), and a norm without them would be silently low (told once)",
            ", ".join(sorted(key)),
        )

    def __call__(self, payload: StepPayload) -> StatBatch:
        if payload.ready is not None:
            payload.ready.synchronize()
        partials = payload.partials.numpy()
        rows = payload.rows
        dropped = np.isnan(partials[:, NANS])  # rows a rank could not compute (StepCollector.finish)
        unread = ()  # gradients left out of the global norm: it is NaN rather than silently low
        if dropped.any():
            unread = tuple(rows[i].name for i in np.flatnonzero(dropped) if rows[i].family == "grad_reduced")
            keep = np.flatnonzero(~dropped)
            partials = partials[keep]
            rows = tuple(rows[i] for i in keep)
        # One pass over the rows for the families present: each helper below scans every row, and a
        # step of `all` on a many-module model has thousands (the worker's time is the GIL's time).
        present = set(map(_FAMILY, rows))
        ratio = moe = attn = None
        if UPDATE_BASE in present:
            rows, partials, ratio = update_ratio(rows, partials)
        if MOE_HIDDEN in present:
            rows, partials, moe = moe_load(rows, partials)
        if ATTN_HIDDEN in present:
            rows, partials, attn = attn_logit(rows, partials)
        numel = np.fromiter(map(_NUMEL, rows), dtype=np.float64, count=len(rows))
        values = finalize(partials, numel)
        if ratio is not None:
            values["ratio"] = ratio
        if moe is not None:  # one row per router, values of its own
            rows, values = moe(rows, values)
        if attn is not None:  # one row per attention layer
            rows, values = attn(rows, values)
        # Global gradient norm from the per-parameter sums of squares (exact across shards, since each
        # written row is already the full parameter's merged statistic).
        reduced = list(compress(range(len(rows)), map("grad_reduced".__eq__, map(_FAMILY, rows))))
        norm = float(np.sqrt(grad_sumsq(partials[reduced]))) if reduced else None
        if payload.job_grad_sumsq is not None:  # a model split over ranks: every rank's written rows
            norm = float(np.sqrt(max(float(payload.job_grad_sumsq), 0.0)))  # NaN if a rank left one out
        elif payload.scalars.partial_grads:
            # Under DDP, parameters trainable only after it was built are each rank's own rows; on a rank
            # that does not write the reduced ones their norm alone is not the model's: none, as on a rank
            # that writes no grad_reduced row
            norm = None
        if unread:
            norm = math.nan
            self._tell_unread(unread)
        scale = payload.scalars.loss_scale
        derived = Derived(
            global_grad_norm=norm,
            loss_scale=None if scale is None else float(scale),
            dropped_rows=self.dropped(),
            monitor_faults=self.faults.total,
        )
        xrank = None
        if payload.tail_meta is not None:
            from trainermon.collect.xrank import decode

            try:
                xrank = decode(payload.tail_meta, payload.tail.numpy())
            except Exception as exc:  # noqa: BLE001 - the step's own rows are still written
                self.faults.record("cross-rank summaries", exc, "this step's summaries are skipped")
        scalars = payload.scalars
        if scalars.update_skipped is not None and not isinstance(scalars.update_skipped, bool):
            # a scaler's found_inf tensor (a fused optimizer's step): read here, off the training thread
            scalars = replace(scalars, update_skipped=bool(float(scalars.update_skipped) != 0))
        batch = StatBatch(payload.step, rows, values, scalars, derived, xrank)
        if self.detector is not None:
            self.detector.check(batch)
            batch = replace(batch, derived=replace(derived, anomalies_total=self.detector.totals()))
        return batch
