"""Shared by the test_parquet*.py modules: monitored runs writing Parquet and their config."""

from __future__ import annotations

import json

import torch

from tests.helpers import LayeredNet as Net
from trainermon import TrainerMon

FULL_OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs", "numel"]


def run_monitored(tmp_path, cfg: dict, steps: int = 5, grad_acc: int = 2, monkeypatch=None) -> TrainerMon:
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, grad_acc_steps=grad_acc, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(grad_acc):
            model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return mon


def full_config(**extra) -> dict:
    cfg = {
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": FULL_OPS,
        "ndigits": 17,  # 17 significant digits: the CSV text is the exact float64
        "format": ["csv", "parquet"],
    }
    cfg.update(extra)
    return cfg
