"""A parameter replaced mid-run under the same name (`m.w = nn.Parameter(...)` swapped into the optimizer,
or a LoRA-style merge): from the step it happens on, its rows read the tensor the
model now holds (param_updated and grad_reduced equal norms computed here), with one warning naming it and
no fault. Before the fix the rows of the old, dead tensor were written (a constant norm, no gradient)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon

STEPS, SWAP_AT = 5, 2


def _swap_in_optimizer(opt: torch.optim.Optimizer, old: torch.Tensor, new: torch.Tensor) -> None:
    for group in opt.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in opt.state:
        opt.state[new] = opt.state.pop(old)


def _replace(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    old = model[2].weight
    model[2].weight = nn.Parameter(old.detach() * 0.5)
    _swap_in_optimizer(opt, old, model[2].weight)  # its Adam state kept


def _lora_merge(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    old = model[2].weight
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, old.shape[1], generator=g), torch.randn(old.shape[0], 2, generator=g)
    model[2].weight = nn.Parameter(old.detach() + 0.1 * b @ a)  # W + (alpha/r) B A, merged
    _swap_in_optimizer(opt, old, model[2].weight)


def _run(tmp_path, model: nn.Module, name: str, change: Callable, batch: Callable, caplog) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = write_config(
        tmp_path / "config.json", wg_distribution=True, param_distribution=True, ops=["norm"], ndigits=17
    )
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    held = dict(model.named_parameters())
    ref: dict[str, dict[int, float]] = {"grad_reduced": {}, "param_updated": {}}
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for step in range(STEPS):
            if step == SWAP_AT:
                change(model, opt)
                held = dict(model.named_parameters())
            loss = batch(model)
            loss.backward()
            ref["grad_reduced"][step] = held[name].grad.double().norm().item()
            opt.step()
            ref["param_updated"][step] = held[name].detach().double().norm().item()
            opt.zero_grad()
    monitor.close()
    assert not dict(monitor.faults.counts)
    for family, want in ref.items():
        got = {
            int(r["step"]): float(r["norm"])
            for r in read_family(monitor.run_dir, family)
            if r["name"] == name
        }
        for step in range(STEPS):
            assert step in got, (family, step)
            assert math.isclose(got[step], want[step], rel_tol=1e-6), (family, step, got[step], want[step])
    said = [r.getMessage() for r in caplog.records if "re-mapped" in r.getMessage()]
    assert len(said) == 1 and name in said[0]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _mlp_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(2, 4)).pow(2).mean()


@pytest.mark.parametrize("change", [_replace, _lora_merge], ids=["replaced", "lora_merge"])
def test_a_replaced_parameter_is_read_from_the_new_tensor(tmp_path, out_dir, static_mode, caplog, change):
    _run(tmp_path, _mlp(), "2.weight", change, _mlp_loss, caplog)
