"""Shared by test_analysis_engines_update.py and test_analysis_not_there.py: the seeded update runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon

STEPS, BUMP_STEP, BUMP = 4, 2, 3.0  # the benchmark's layers.1.weight gradient x BUMP at BUMP_STEP


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.final_norm = nn.LayerNorm(4)  # bias starts at zero: its first ratio is Inf (dw / 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.final_norm(x).pow(2).mean()


def _with_output_dir(out: Path, fn):
    old = os.environ.get("MONITOR_OUTPUT_DIR")
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = old


def _train(out: Path, bump: bool) -> Path:
    cfg = write_config(
        out.parent / f"{out.name}.json",
        update_distribution=True,
        wg_distribution=True,
        ops=["norm", "mean", "min", "max", "nans", "infs", "numel"],
        format=["csv", "parquet"],
    )

    def run() -> None:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            model(torch.randn(3, 4, generator=gen)).backward()
            if bump and step == BUMP_STEP:
                model.layers[1].weight.grad.mul_(BUMP)
            opt.step()
            opt.zero_grad()
        mon.close()

    _with_output_dir(out, run)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("update_runs")
    return {"run": _train(root / "run", bump=False), "bench": _train(root / "bench", bump=True)}
