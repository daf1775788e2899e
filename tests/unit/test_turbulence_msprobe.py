"""`AnomalyTurbulence` flags what msprobe 26.2's flags: a tiny model's gradient statistics go through
trainermon's detector (in the monitor) and through msprobe's own (`BaseWriterWithAD.add_scalar`, the call
its writers make per statistic), keeping trainermon's fixes: only the statistics `ops` holds, non-finite
values left to `AnomalyNan` (in msprobe a NaN poisons the average for good)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.config.schema import AlertConfig
from trainermon.pipeline.anomaly import AnomalyDetector
from trainermon.pipeline.rule_specs import parse_rules

THRESHOLD = 0.05
RULES = [{"rule_name": "AnomalyTurbulence", "args": {"threshold": THRESHOLD}}]


def _msprobe_writer():
    """msprobe's detector, as its CSV writer holds it (its rules parsed by msprobe itself)."""
    msprobe = pytest.importorskip("msprobe.pytorch.monitor.data_writers")
    from msprobe.core.monitor.anomaly_processor import AnomalyDataFactory, AnomalyScanner

    rules = AnomalyScanner.load_rules(RULES)
    factory = AnomalyDataFactory(0, 0, [0])
    return msprobe.BaseWriterWithAD(msprobe.WriterInput("unused", rules, "job", factory))


def _msprobe_flags(writer, tag: tuple[str, str], value: float, step: int) -> bool:
    before = len(writer.anomalies)
    writer.add_scalar(tag, value, step)
    return len(writer.anomalies) > before


def test_turbulence_flags_the_steps_msprobe_flags(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ops = ["norm", "mean", "max"]
    alert = {"rules": RULES, "dump": True}
    monitor = TrainerMon(
        write_config(tmp_path / "c.json", targets={}, wg_distribution=True, ops=ops, alert=alert)
    )
    monitor.set_monitor(model, optimizer=opt)
    writer = _msprobe_writer()
    theirs, plain_mean = set(), set()
    history: dict[tuple, list[float]] = {}
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(8):
            opt.zero_grad()
            model(torch.randn(6, 8, generator=gen)).square().mean().backward()
            opt.step()
            monitor.flush()
            batch = monitor.last_batch
            for i, row in enumerate(batch.rows):
                if row.family != "grad_reduced":
                    continue
                for op in ops:  # msprobe's order: every statistic of a tensor, then the next tensor
                    value = float(batch.values[op][i])
                    if _msprobe_flags(writer, (f"{row.name}/rank0/post_grad", op), value, step):
                        theirs.add((row.name, step, op))
                    earlier = history.setdefault((row.name, op), [])
                    if op != "max" and earlier and value > (1 + THRESHOLD) * np.mean(earlier) > 0:
                        plain_mean.add((row.name, step, op))  # the rule trainermon had before
                    earlier.append(value)
    finally:
        monitor.close()
    (path,) = Path(out).glob("**/anomaly_detected/anomaly_rank0.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ours = {(r["name"], r["step"], r["stat"]) for r in records if r["rule"] == "AnomalyTurbulence"}
    assert theirs, "the run must give msprobe's rule something to flag"
    assert ours == theirs
    assert plain_mean != theirs  # the case tells the two rules apart
    assert {r["stat"] for r in records} <= {"norm", "mean"}


def _batch(step: int, **columns: list[float]) -> StatBatch:
    meta = RowMeta("grad_reduced", 0, "w", None, (4,), torch.float32, 4)
    return StatBatch(step, [meta], {k: np.array(v, dtype=np.float64) for k, v in columns.items()})


def test_only_the_statistics_ops_holds_are_checked(tmp_path):
    """ops [norm, max]: the mean is still computed (other rows need it) but is no statistic of the user's,
    and msprobe checks only those it collects."""
    detector = AnomalyDetector.for_job(AlertConfig(rules=tuple(RULES)), str(tmp_path), 0, ops=("norm", "max"))
    found = []
    for step, (norm, mean) in enumerate([(1.0, 0.1), (1.0, 0.1), (2.0, 5.0)]):
        found += detector.check(_batch(step, norm=[norm], mean=[mean], max=[norm]))
    detector.close()
    assert [(a.step, a.stat, a.baseline) for a in found] == [(2, "norm", pytest.approx(1.0))]


def test_a_non_finite_value_neither_fires_nor_poisons_the_average(tmp_path):
    """msprobe's average turns NaN after a NaN (no Turbulence again), inf after an inf; here both are
    skipped (`AnomalyNan` reports them) and the average goes on: an independent recomputation of
    msprobe's rule over the finite values."""
    detector = AnomalyDetector(parse_rules(RULES), str(tmp_path), 0)
    series = [1.0, 1.02, math.nan, 1.0, math.inf, -1.2, 1.03, 1.5]
    fired = [bool(detector.check(_batch(step, norm=[v]))) for step, v in enumerate(series)]
    detector.close()
    want, avg = [], None
    for value in series:
        if not math.isfinite(value):
            want.append(False)
            continue
        avg = abs(value) if avg is None else avg
        want.append(abs(value) > avg * (1 + THRESHOLD))
        avg = 0.99 * avg + 0.01 * abs(value)
    assert fired == want == [False, False, False, False, False, True, False, True]


def test_the_monitor_hands_its_ops_to_the_detector(tmp_path, monkeypatch):
    """End to end: a monitor with ops [norm, max] never reports a Turbulence of `mean` (computed for other
    rows, but not a statistic the user asked for)."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    alert = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.0}}], "dump": True}
    ops = ["norm", "max"]
    cfg = write_config(tmp_path / "c.json", targets={}, wg_distribution=True, ops=ops, alert=alert)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(2)
    for step in range(8):  # inputs that grow: every gradient statistic grows past its average
        model(torch.randn(8, 4, generator=gen) * (1 + step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    lines = [json.loads(x) for p in out.rglob("anomaly_rank0.jsonl") for x in p.read_text().splitlines()]
    stats = {rec.get("stat") or rec.get("metric") for rec in lines}
    assert lines and "norm" in stats and "mean" not in stats, stats
