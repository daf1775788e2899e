"""AnomalyNan on a step the loss scaler skipped: the scaler's Inf gradients are no anomaly, the rest is."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.pipeline.anomaly import load_anomalies


def test_a_scaler_skip_is_no_nan_anomaly_but_a_non_finite_weight_is(tmp_path, monkeypatch):
    """A real torch GradScaler skips step 2 (its loss overflows): `skipped` is set and the step's gradient
    rows hold the Inf, but no AnomalyNan is recorded for them or the global norm (the scaler did its job;
    Prometheus counts such a step as skipped, not non-finite). At step 3 a weight holds a NaN, which no
    scaler explains: that one is an anomaly, in the parameter family and in the gradients it poisons."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(
        tmp_path / "c.json",
        targets={},
        wg_distribution=True,
        param_distribution=True,
        ops=["norm", "nans"],
        format="csv",
        alert={"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        loss = model(torch.randn(3, 4)).pow(2).mean()
        if step == 2:
            loss = loss * 1e38 * 1e38  # inf: the scaler finds Inf gradients and skips the update
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monitor.close()
    run_dir = monitor.run_dir
    rows = read_family(run_dir, "grad_reduced")
    skipped = {int(r["step"]): r["skipped"] for r in rows}
    assert skipped[2] == "1" and skipped[1] != "1"
    assert any(float(r["nans"]) > 0 or r["norm"] in ("inf", "nan") for r in rows if r["step"] == "2")
    records = load_anomalies(str(tmp_path / "out"))
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add((r["family"], r["name"]))
    assert 2 not in by_step, by_step[2]  # the scaler's skip
    assert ("param_origin", "2.weight") in by_step[3]  # a NaN weight, no scaler at work
    assert all(r["rule"] == "AnomalyNan" for r in records)
