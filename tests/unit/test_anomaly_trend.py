"""AnomalySpike while the norm is still trending (early training): the window's trend is taken out."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from trainermon.analysis.trends import find_spikes
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector
from trainermon.pipeline.rule_specs import parse_rules


def _fired(tmp_path, values: np.ndarray) -> list[int]:
    """The steps AnomalySpike (default arguments) fires at, online; the offline finder must agree."""
    rules = parse_rules([{"rule_name": "AnomalySpike"}])
    detector = AnomalyDetector(rules, str(tmp_path), rank=0, dump=False)
    row = [RowMeta("grad_reduced", 0, "w", None, (4,), torch.float32, 4)]
    fired = [s for s, v in enumerate(values) if detector.check(StatBatch(s, row, {"norm": np.array([v])}))]
    detector.close()
    assert find_spikes(pd.Series(values, index=range(len(values))))["step"].tolist() == fired
    return fired


def _falling(seed: int, steps: int = 300, fall: float = 25.0, noise: float = 0.1) -> np.ndarray:
    """A norm falling `fall`x every 50 steps (log-linear), with `noise` log-normal noise."""
    rng = np.random.default_rng(seed)
    return np.exp(-np.log(fall) / 50 * np.arange(steps) + rng.normal(0, noise, steps))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_spike_during_a_falling_norm_fires_once(tmp_path, seed):
    """A 30x one-step spike while the norm falls 25x over the window: the raw window's MAD (~1 in log)
    made z=6 demand a ~400x spike over a lagging median, so it was missed."""
    values = _falling(seed)
    values[100] *= 30
    assert _fired(tmp_path, values) == [100]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fall", [1.0, 8.0, 25.0])
def test_a_healthy_trending_or_stationary_norm_never_fires(tmp_path, seed, fall):
    assert _fired(tmp_path, _falling(seed, fall=fall, noise=0.2)) == []


def test_a_norm_that_falls_to_zero_and_rises_again_does_not_fire(tmp_path):
    """A bias's norm |b| as b crosses 0: the fall turns into a rise, which the trend's extrapolation
    alone would take for a spike; the last three values' median bounds the expected value from below."""
    b = 0.014 - 0.0006 * np.arange(300) + np.random.default_rng(0).normal(0, 1e-5, 300)
    assert _fired(tmp_path, np.abs(b)) == []


def test_a_lasting_change_of_level_fires_on_at_most_its_first_two_steps(tmp_path):
    values = _falling(0, fall=8.0, noise=0.05)
    values[150:] *= 10
    fired = _fired(tmp_path, values)
    assert fired[0] == 150 and fired == list(range(150, 150 + len(fired))) and len(fired) <= 2, fired
