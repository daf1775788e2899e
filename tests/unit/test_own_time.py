"""The monitor's own time (`monitor_time_ms`, the benchmarks' "own" figure) counts every part of its hooks
on the training thread, not only the rows they add."""

from __future__ import annotations

import time

import torch
from torch import nn

import trainermon.runtime.probes.activations as activations
from tests.helpers import write_config
from trainermon import TrainerMon

DELAY_S = 0.002


def test_own_time_counts_the_activation_hooks_whole_bodies(tmp_path, monkeypatch):
    # Slow down two parts of the hooks that run before any row is added: the pre-hook's view for the
    # input gradient and the forward hook's reading of the module's outputs. time.sleep sleeps at least
    # DELAY_S, so the step's own time is at least the slowed calls times DELAY_S if the clock covers them.
    calls = []
    real_view, real_slots = activations.ActivationProbe._hook_view, activations.output_slots

    def slow_view(self, *args):
        calls.append("view")
        time.sleep(DELAY_S)
        return real_view(self, *args)

    def slow_slots(output):
        calls.append("slots")
        time.sleep(DELAY_S)
        return real_slots(output)

    monkeypatch.setattr(activations.ActivationProbe, "_hook_view", slow_view)
    monkeypatch.setattr(activations, "output_slots", slow_slots)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = write_config(tmp_path / "cfg.json", xy_distribution=True, all_xy=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    payloads = []
    monitor.loop.worker.submit = lambda payload: payloads.append(payload) or True
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    optimizer.step()
    monitor.close()

    assert calls.count("view") >= 3 and calls.count("slots") >= 3, calls  # every module's hooks ran
    own_ms = payloads[0].scalars.monitor_time_ms
    assert own_ms >= len(calls) * DELAY_S * 1e3, (own_ms, len(calls))
