"""`SpikeWindow`: the rolling, trend-aware robust spike test behind `AnomalySpike` and the offline
analysis' spikes."""

from __future__ import annotations

import math
from collections import deque
from itertools import islice

#: SpikeWindow removes the window's trend once it holds this many values (fewer: the plain median/MAD test).
DETREND_MIN = 16


class SpikeWindow:
    """Rolling window of log values with a robust, trend-aware (median / MAD) spike test: the online
    `AnomalySpike` rule and the offline analysis' spikes (`analysis.trends.find_spikes`).

    With n >= DETREND_MIN values: slope = (median of the newest n//2 - median of the oldest n//2) /
    (n - n//2); residual_i = log value_i - slope * i; expected = median(residuals) + slope * n, but no
    lower than the median of the last three values; deviation = 1.4826 * MAD(residuals) *
    sqrt(1 + DETREND_MIN / n). With fewer: slope 0, expected = median, deviation = 1.4826 * MAD. A
    spike: log(value) - expected > z * max(deviation, log1p(min_rel)); its baseline is exp(expected)."""

    __slots__ = ("values",)

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def check_then_add(self, value: float, warmup: int, z: float, min_rel: float) -> float | None:
        """Return the baseline (the expected value) if `value` is a spike, else None. Non-finite and
        non-positive values are skipped."""
        if not (value > 0 and math.isfinite(value)):
            return None
        logv = math.log(value)
        baseline = None
        n = len(self.values)
        if n >= warmup:
            # Plain sorts: np.median on a 50-value window cost ~100 us a row (21 ms a step of 212 rows,
            # on the worker), more than the step it judged.
            values = self.values
            slope, inflate = 0.0, 1.0
            if n >= DETREND_MIN:
                # A falling (or rising) norm, early in training: the window's trend (the difference of its
                # halves' medians over the distance of their centres) is taken out, else it inflates the
                # MAD (a 25x fall over 50 values made z=6 demand a ~400x spike) and the median lags.
                half = n // 2
                recent, early = sorted(islice(values, n - half, n)), sorted(islice(values, half))
                slope = (_median(recent) - _median(early)) / (n - half)
                # the slope's own error, extrapolated to the new value, widens the deviation
                inflate = math.sqrt(1 + DETREND_MIN / n)
            residuals = sorted([v - slope * i for i, v in enumerate(values)])
            level = _median(residuals)
            mad = _median(sorted([abs(r - level) for r in residuals])) * 1.4826 * inflate
            expected = level + slope * n  # the trend extrapolated to the new value's position
            if n >= DETREND_MIN:
                # ... but no lower than the last three values' median: a trend that turns (a bias's norm
                # falling to 0 and rising again) is no spike, nor is one that steepens.
                expected = max(expected, sorted((values[-1], values[-2], values[-3]))[1])
            # A floor on the deviation: a perfectly steady series must not make tiny wiggles spikes.
            if logv - expected > z * max(mad, math.log1p(min_rel)):
                baseline = math.exp(expected)
        # Every value enters the window, spikes too: the median and MAD ignore a minority of outliers, so
        # an isolated spike does not move the baseline, while a lasting change of level (Adam's moments
        # after a gradient spike, a run resumed after dynamic_on was off) fires on at most its first 2
        # collections once the window holds DETREND_MIN values (the last three values' median is then at
        # the new level; before that, until it fills half the window) instead of firing (and escalating)
        # on every collected step forever.
        self.values.append(logv)
        return baseline


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    half = n // 2
    return ordered[half] if n % 2 else 0.5 * (ordered[half - 1] + ordered[half])
