"""AnomalySpike's window (online) and the offline analysis' spikes: one test, a level change absorbed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from trainermon.analysis.trends import find_spikes
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector
from trainermon.pipeline.rule_specs import parse_rules


def _series() -> np.ndarray:
    """500 noisy values (2% noise): level 1 until step 100, then 10 for good; one x50 spike at step 300."""
    values = np.where(np.arange(500) < 100, 1.0, 10.0) * np.exp(np.random.default_rng(0).normal(0, 0.02, 500))
    values[300] *= 50
    return values


def test_a_lasting_change_of_level_is_absorbed_and_a_later_spike_still_fires(tmp_path):
    """A quantity that moves to a new level and stays there (Adam's moments after a gradient spike, a run
    resumed after dynamic_on was off) fired on every later collected step, each firing also escalating:
    the window kept only non-spike values, so the new level never entered it. Every value enters it now;
    its robust trend ignores a minority of outliers, so the new level is the baseline after at most two
    firings (the last three values' median is then at it), and the isolated spike at step 300 fires once,
    alone."""
    values = _series()
    rules = parse_rules([{"rule_name": "AnomalySpike"}])
    detector = AnomalyDetector(rules, str(tmp_path), rank=0, dump=False)
    row = [RowMeta("exp_avg_sq", 0, "w", None, (4,), torch.float32, 4)]
    fired = [s for s, v in enumerate(values) if detector.check(StatBatch(s, row, {"norm": np.array([v])}))]
    detector.close()
    level_change = [s for s in fired if s < 300]
    assert level_change[0] == 100 and level_change[-1] < 130, fired  # absorbed within a few steps
    assert [s for s in fired if s >= 130] == [300], fired
    # The offline analysis finds the very same steps in the same series (one implementation of the test).
    assert find_spikes(pd.Series(values, index=range(500)))["step"].tolist() == fired
