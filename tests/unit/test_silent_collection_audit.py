"""Nothing silent (config audit h49), at collection: a selection that matched nothing the job runs gave no
rows and no word.

- `cc_distribution.ops` naming no collective the job calls: said once after the first collected step,
  naming the collectives called there (as a `cc_codeline` matching no site is said with the sites seen);
- an `xy_distribution` target module that never runs forward: said once, naming it;
- an optimizer holding none of the model's parameters: no state rows and param_updated == param_origin,
  said once (the partial case keeps its own sentence: `test_closures.py`).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tests.distributed import free_port
from tests.helpers import read_family, write_config
from trainermon import TrainerMon


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def one_gloo_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ops", [["broadcast"], ["all_reduce"], ["broadcast", "all_reduce"]])
def test_cc_ops_that_see_no_call_are_said(tmp_path, out_dir, static_mode, one_gloo_rank, caplog, ops):
    cfg = write_config(tmp_path / "cfg.json", cc_distribution={"enable": True, "ops": ops})
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    calls, wrapped = [], []
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            # which collectives the monitor's wrappers hold during this (collected) step
            wrapped.append(
                tuple(hasattr(f, "__trainermon_comm__") for f in (dist.all_reduce, funcol.all_reduce))
            )
            made = 0
            for p in model.parameters():
                dist.all_reduce(p.grad)
                made += 1
            calls.append(made)
            opt.step()
            opt.zero_grad()
        monitor.close()
    rows = read_family(monitor.run_dir, "comm")
    # the spy wraps every collective but the unwatched functional ones, on the first collected step only
    # (functional wrappers break a fullgraph compile); later steps wrap `ops`' alone
    watched = "all_reduce" in ops
    assert wrapped == [(True, False), (watched, False), (watched, False)], wrapped
    said = [m for m in _warnings(caplog) if "saw no call" in m]
    if "all_reduce" in ops:  # Reference: the job's all_reduces are watched, one row per call site and step
        assert not said and {int(r["step"]) for r in rows} == {0, 1, 2}
    else:
        assert not rows and len(said) == 1, said
        assert "cc_distribution.ops ['broadcast']" in said[0] and f"all_reduce x{calls[0]}" in said[0]
        assert "counted only with 'funcol' in ops" in said[0]  # the spy does not wrap them: not "none"


def test_xy_target_that_never_runs_is_said_once(tmp_path, out_dir, static_mode, caplog):
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "spare": nn.Linear(4, 4)})
    forwards = {"used": 0, "spare": 0}
    for name in forwards:
        model[name].register_forward_hook(
            lambda m, a, o, name=name: forwards.__setitem__(name, forwards[name] + 1)
        )
    cfg = write_config(
        tmp_path / "cfg.json", xy_distribution=True, ops=["norm"], targets={"used": {}, "spare": {}}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        for _ in range(3):
            x = torch.randn(2, 4)
            model["used"](x).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    names = {r["name"].split(".")[0] for r in read_family(monitor.run_dir, "actv")}
    # Reference: the hooks counted 3 forwards of 'used', none of 'spare'; rows follow
    assert forwards == {"used": 3, "spare": 0} and names == {"used"}
    said = [m for m in _warnings(caplog) if "ran no forward" in m]
    assert len(said) == 1 and "1 of the 2 selected modules" in said[0], said
    assert "configuration): spare;" in said[0], said


class _Stack(nn.Module):
    """Blocks in an nn.ModuleList, run one by one: the list itself has no forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_xy_targets_that_all_run_say_nothing(tmp_path, out_dir, static_mode, caplog):
    model = _Stack()  # every module selected (default targets), the ModuleList container included
    cfg = write_config(tmp_path / "cfg.json", xy_distribution=True, ops=["norm"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    assert not [m for m in _warnings(caplog) if "ran no forward" in m]


def test_optimizer_holding_none_of_the_models_parameters_is_said(tmp_path, out_dir, static_mode, caplog):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    other = nn.Linear(4, 2)
    opt = torch.optim.Adam(other.parameters(), lr=0.1)
    cfg = write_config(tmp_path / "cfg.json", mv_distribution=True, param_distribution=True, ops=["norm"])
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        want = {n: float(p.detach().double().norm()) for n, p in model.named_parameters()}
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            other(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    origin = {
        r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "param_origin") if r["step"] == "0"
    }
    updated = {
        r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "param_updated") if r["step"] == "0"
    }
    # Reference: the model's own parameters, never updated: what the rows show, and no exp_avg rows
    assert origin == pytest.approx(want, rel=1e-5) and updated == pytest.approx(want, rel=1e-5)
    assert not read_family(monitor.run_dir, "exp_avg")
    said = [m for m in _warnings(caplog) if "holds none of the model's" in m]
    assert len(said) == 1 and "2 trainable parameters" in said[0], said
    assert not [m for m in _warnings(caplog) if "not in the monitored optimizer" in m]
