"""A re-run notebook cell (a new monitor on the same model or optimizer, the old one never closed) closes
the older monitor with a warning, instead of stacking monitors that all hook and all write."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import read_family, write_config
from trainermon import TrainerMon


def _hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return n + len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def _train(model, opt, steps: int, ref: dict, first: int) -> None:
    for step in range(first, first + steps):
        model(torch.randn(3, 8)).square().sum().backward()
        for name, p in model.named_parameters():
            ref[(name, step)] = float(p.grad.double().norm())
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("rebuilt", [False, True], ids=["same-optimizer", "new-optimizer"])
def test_rerun_cell_closes_the_older_monitor(tmp_path, monkeypatch, caplog, rebuilt):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, xy_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bare = _hooks(model, opt)
    first = TrainerMon(cfg)  # the cell's first run
    first.set_monitor(model, optimizer=opt)
    one = _hooks(model, opt)
    ref_first: dict = {}
    _train(model, opt, 2, ref_first, 0)
    if rebuilt:  # the cell builds its optimizer anew, on the same model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        second = TrainerMon(cfg)  # the cell run again: `first` is never closed
        second.set_monitor(model, optimizer=opt)
    assert first.loop.closed  # the old code kept both attached (hooks 2x, both dirs written)
    said = [r.getMessage() for r in caplog.records]
    assert any("still attached" in m and first.run_dir in m for m in said), said
    assert _hooks(model, opt) - bare == one - bare > 0  # one monitor's hooks, not two
    ref_second: dict = {}
    _train(model, opt, 3, ref_second, 0)
    second.close()
    for run_dir, ref in ((first.run_dir, ref_first), (second.run_dir, ref_second)):
        rows = read_family(run_dir, "grad_reduced")
        got = {(r["name"], int(r["step"])): float(r["norm"]) for r in rows}
        assert sorted(got) == sorted(ref), run_dir  # the first ends at step 1: closed before step 2
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key


def test_other_model_keeps_its_monitor(tmp_path, monkeypatch):
    """Two monitors on two models (and optimizers) at once stay attached, unwarned."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"])
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ma, mb = TrainerMon(cfg), TrainerMon(cfg)
    ma.set_monitor(a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
    mb.set_monitor(b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1))
    assert not ma.loop.closed and not mb.loop.closed
    ma.close()
    mb.close()
