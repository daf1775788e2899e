"""TrainerMon.state_dict(): a job restored from a checkpoint continues its monitoring where it left off.

One run trains 10 steps under one monitor. The same training interrupted after step 3 and resumed with a
new monitor (`load_state_dict` of the first one's state) must write the same rows and find the same
anomalies: the schedule's count of collected steps (collect_times 6) and the anomaly rule's history (a
spike at step 5 that only a 4-step warm-up can see) carry over.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.pipeline.anomaly import load_anomalies

STEPS, CUT, SPIKE = 10, 4, 5
FAMILIES = ("actv", "grad_reduced", "exp_avg", "param_updated")


def _config(path):
    return write_config(
        path,
        xy_distribution=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        collect_times=6,
        ops=["norm", "mean", "max"],
        ndigits=17,
        alert={"rules": [{"rule_name": "AnomalySpike", "args": {"warmup": 4, "z": 4}}], "dump": True},
    )


class Trainer:
    """A model, its optimizer and its data: the same trajectory however the monitors come and go."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(1)

    def step(self, step: int) -> None:
        x = torch.randn(4, 6, generator=self.gen)
        scale = 1000.0 if step == SPIKE else 1.0
        (self.model(x).pow(2).mean() * scale).backward()
        self.opt.step()
        self.opt.zero_grad()


def _rows(run_dirs: list[str]) -> dict:
    out = {}
    for family in FAMILIES:
        for run_dir in run_dirs:
            for r in read_family(run_dir, family):
                key = (family, r["name"], int(r["step"]), r.get("micro_step"))
                assert key not in out, key
                out[key] = (r["norm"], r["mean"], r["max"])
    return out


def _monitor(tmp_path, name: str, monkeypatch) -> TrainerMon:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / name))
    return TrainerMon(_config(tmp_path / f"{name}.json"))


def _resumed(tmp_path, monkeypatch, name: str, load: bool) -> tuple[dict, list]:
    trainer = Trainer()
    first = _monitor(tmp_path, name, monkeypatch)
    first.set_monitor(trainer.model, optimizer=trainer.opt)
    for step in range(CUT):
        trainer.step(step)
    state = first.state_dict()
    first.close()
    second = _monitor(tmp_path, name, monkeypatch)
    if load:
        second.load_state_dict(state)  # before set_monitor, as a training script restoring a checkpoint
    second.set_monitor(trainer.model, optimizer=trainer.opt, start_iteration=CUT)
    for step in range(CUT, STEPS):
        trainer.step(step)
    second.close()
    assert first.faults.total == 0 and second.faults.total == 0
    return _rows([first.run_dir, second.run_dir]), load_anomalies(str(tmp_path / name))


def test_resumed_run_writes_the_same_rows_and_anomalies(tmp_path, monkeypatch):
    trainer = Trainer()
    whole = _monitor(tmp_path, "whole", monkeypatch)
    whole.set_monitor(trainer.model, optimizer=trainer.opt)
    for step in range(STEPS):
        trainer.step(step)
    whole.close()
    expected = _rows([whole.run_dir])
    expected_anomalies = load_anomalies(str(tmp_path / "whole"))
    assert {k[2] for k in expected} == set(range(6))  # collect_times 6
    assert {a["step"] for a in expected_anomalies} == {SPIKE}

    rows, anomalies = _resumed(tmp_path, monkeypatch, "resumed", load=True)
    assert rows == expected
    strip = ("time", "rank", "run_id")  # two jobs: two run ids
    assert [{k: v for k, v in a.items() if k not in strip} for a in anomalies] == [
        {k: v for k, v in a.items() if k not in strip} for a in expected_anomalies
    ]

    # Without the state the second monitor starts over: more steps collected, the spike unseen.
    rows, anomalies = _resumed(tmp_path, monkeypatch, "restarted", load=False)
    assert {k[2] for k in rows} == set(range(STEPS)) and anomalies == []


def test_state_loaded_after_set_monitor_applies_at_once(tmp_path, monkeypatch):
    trainer = Trainer()
    monitor = _monitor(tmp_path, "late", monkeypatch)
    monitor.set_monitor(trainer.model, optimizer=trainer.opt, start_iteration=CUT)
    monitor.load_state_dict({**monitor.state_dict(), "step": 7, "schedule_collected": 6})
    assert monitor.current_step == 7 and not monitor.loop.plan.collecting  # collect_times used up
    trainer.step(7)
    monitor.close()
    assert read_family(monitor.run_dir, "grad_reduced") == []


def test_a_malformed_state_is_refused_naming_the_key(tmp_path, monkeypatch):
    monitor = _monitor(tmp_path, "bad", monkeypatch)
    good = monitor.state_dict()
    for bad, named in (
        (None, "NoneType"),
        ({k: v for k, v in good.items() if k != "step"}, "'step' is None"),
        ({**good, "schedule_collected": "3"}, "'schedule_collected' is '3'"),
        ({**good, "step": -1}, "'step' is -1"),
    ):
        with pytest.raises(ValueError, match="allowed|a dict") as info:
            monitor.load_state_dict(bad)
        assert named in str(info.value), (named, str(info.value))
    monitor.close()
