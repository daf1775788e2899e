"""set_monitor with optimizers inside wrappers: any object holding the real one as `.optimizer` (nested
too) is unwrapped, what was hooked is said in one line, and a torch.optim.Optimizer subclass that never
ran torch's __init__ (accelerate's pattern) is no longer handed to register_step_pre_hook."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, ref_stats, write_config


class Holder:
    """A user's own wrapper: steps the optimizer it holds."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class HalfInitialised(torch.optim.Optimizer):
    """Subclasses torch's Optimizer without running its __init__ and holds no `.optimizer`."""

    def __init__(self, params) -> None:
        self.param_groups = [{"params": list(params), "lr": 0.1}]
        self.state: dict = {}

    def step(self, closure=None):
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.sub_(0.1 * p.grad)


def _attach(tmp_path, caplog, optimizer, model):
    from trainermon import TrainerMon

    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], ndigits=12))
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor.set_monitor(model, optimizer=optimizer)
    lines = [r.getMessage() for r in caplog.records if "attached" in r.getMessage()]
    assert len(lines) == 1
    return monitor, lines[0]


def test_nested_wrappers_are_unwrapped(tmp_path, out_dir, static_mode, caplog):
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = Holder(Holder(sgd))
    monitor, line = _attach(tmp_path, caplog, wrapped, model)
    assert monitor.loop.adapter.optimizer is sgd and "optimizer Holder -> Holder -> SGD" in line
    refs = []
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        refs.append(ref_stats(model.weight.grad)["norm"])
        wrapped.step()
        wrapped.zero_grad()
    monitor.close()
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert [float(rows[("weight", s, None)]["norm"]) for s in range(2)] == pytest.approx(refs, rel=1e-6)


def test_cycle_and_half_initialised_optimizer(tmp_path, out_dir, static_mode, caplog):
    model = nn.Linear(3, 2)
    odd = HalfInitialised(model.parameters())
    odd.optimizer = odd  # `.optimizer` leading back to itself: unwrapping stops
    monitor, line = _attach(tmp_path, caplog, odd, model)
    assert "optimizer HalfInitialised)" in line  # the chain stopped at once
    model(torch.randn(4, 3)).sum().backward()
    odd.step()  # its step() is wrapped (no torch step hooks exist on it), so the step still advances
    assert monitor.current_step == 1
    monitor.close()
    assert monitor.faults.total == 0


def test_no_optimizer_says_so(tmp_path, out_dir, static_mode, caplog):
    monitor, line = _attach(tmp_path, caplog, None, nn.Linear(3, 2))
    assert "optimizer none hooked: call monitor.step()" in line
    monitor.close()
