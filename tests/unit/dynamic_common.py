"""Shared by the test_dynamic*.py modules: training under a watched config file, reading collected steps."""

from __future__ import annotations

import csv
import glob
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from trainermon import TrainerMon

BASE = {"wg_distribution": True, "ops": ["norm"], "dynamic_on": False, "collect_times": 100}


def _collected_steps(out_root: str, family: str = "grad_reduced") -> list[int]:
    steps: set[int] = set()
    for path in glob.glob(os.path.join(out_root, "*", f"{family}_*.csv")):
        with open(path, newline="") as fh:
            steps |= {int(r["step"]) for r in csv.DictReader(fh)}
    return sorted(steps)


def _wait_dirty(monitor: TrainerMon, timeout: float = 30.0) -> None:
    watcher = monitor.loop.control.watcher
    deadline = time.monotonic() + timeout
    while not watcher.dirty and time.monotonic() < deadline:
        time.sleep(0.005)
    assert watcher.dirty, "the watcher did not see the save"


def _train(
    cfg_path: str,
    steps: int,
    actions: dict[int, Callable[[TrainerMon], None]],
    process_group=None,
    before_attach: Callable[[TrainerMon], None] | None = None,
) -> TrainerMon:
    """`steps` steps of a tiny model; `actions[i]` runs before step i, `before_attach` between
    `TrainerMon()` and `set_monitor`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg_path, process_group=process_group)
    if before_attach is not None:
        before_attach(monitor)
    monitor.set_monitor(model, optimizer=opt)
    for i in range(steps):
        if i in actions:
            actions[i](monitor)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor
