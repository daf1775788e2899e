"""mv_distribution beyond Adam: each optimizer's state under its own key names (runtime/moments.py), values
against the optimizer's own state tensors after each update, and one warning when nothing matches."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
STEPS = 3


class Velocity(torch.optim.Optimizer):
    """An optimizer trainermon does not know: a parameter-shaped `velocity`, a scalar `count`, and a
    `scratch` tensor of another shape (not a parameter-shaped state: not reported)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["velocity"], st["count"], st["scratch"] = (
                        torch.zeros_like(p),
                        torch.zeros(()),
                        torch.ones(7),
                    )
                st["velocity"].mul_(0.5).add_(p.grad)
                st["count"] += 1
                p.add_(st["velocity"], alpha=-group["lr"])


class Stateless(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = torch.ones(())
                p.sub_(0.1 * p.grad)


CASES = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",)),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), ("sum",)),
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=0.01), ("row_var", "col_var", "variance")),
    "rmsprop": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
        ("square_avg", "momentum_buffer", "grad_avg"),
    ),
    "adam_amsgrad": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    ),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.01), ("exp_avg", "exp_avg_sq")),
    "unknown": (lambda ps: Velocity(ps), ("velocity",)),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=0.01), ("exp_avg", "exp_inf")),
    "rprop": (lambda ps: torch.optim.Rprop(ps, lr=0.01), ("prev", "step_size")),
    "adadelta": (lambda ps: torch.optim.Adadelta(ps), ("square_avg", "acc_delta")),
    "asgd": (lambda ps: torch.optim.ASGD(ps, lr=0.01), ("ax",)),
    "muon": (lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=0.01), ("momentum_buffer",)),
}
ALL_KEYS = {k for _, keys in CASES.values() for k in keys} | {"count", "scratch", "step", "eta", "mu"}


def _run(tmp_path, make_opt):
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", mv_distribution=True, ops=list(OPS), ndigits=12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = make_opt(model.parameters())
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    refs: dict = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        model(torch.randn(6, 5, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor):
                    refs[(key, name, step)] = (ref_stats(value), list(value.shape))
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    return monitor, refs


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_rows_equal_the_optimizers_own(tmp_path, out_dir, static_mode, caplog, case):
    make_opt, keys = CASES[case]
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _run(tmp_path, make_opt)
    assert not [r for r in caplog.records if "mv_distribution" in r.getMessage()]
    for key in keys:
        rows = keyed(read_family(monitor.run_dir, key))
        want = {(n, s, None) for (k, n, s) in refs if k == key}
        assert rows and set(rows) == want, (key, sorted(set(rows) ^ want))
        for (n, s, _), row in rows.items():
            ref, shape = refs[(key, n, s)]
            assert row["shape"].replace(" ", "") == str(shape).replace(" ", "")
            assert_row_matches(row, ref, OPS)
    for key in ALL_KEYS - set(keys):  # nothing else: no scalars, no other-shaped scratch, no absent keys
        assert not read_family(monitor.run_dir, key), key


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_transformers_adafactor_is_not_taken_for_torchs(tmp_path, out_dir, static_mode, caplog, beta1):
    """transformers' Adafactor shares torch's class name but keeps exp_avg_sq_row/_col/exp_avg_sq (and
    exp_avg with beta1). Before: given torch's keys, which its state never has: no rows, no warning."""
    from transformers.optimization import Adafactor

    def make(ps):
        return Adafactor(ps, lr=0.01, relative_step=False, scale_parameter=False, beta1=beta1)

    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _run(tmp_path, make)
    assert not [r for r in caplog.records if "mv_distribution" in r.getMessage()]
    keys = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq") + (("exp_avg",) if beta1 else ())
    for key in keys:
        rows = keyed(read_family(monitor.run_dir, key))
        want = {(n, s, None) for (k, n, s) in refs if k == key}
        assert rows and set(rows) == want, (key, sorted(set(rows) ^ want))
        for (n, s, _), row in rows.items():
            assert_row_matches(row, refs[(key, n, s)][0], OPS)
    assert keyed(read_family(monitor.run_dir, "exp_avg_sq_row"))[("0.weight", 0, None)]["shape"] == "[4]"
    for key in {"row_var", "col_var", "variance", "exp_avg"} - set(keys):
        assert not read_family(monitor.run_dir, key), key


class SGD(torch.optim.Optimizer):
    """Another package's `SGD`: the name of torch's, a state of its own (`velocity`)."""

    step = Velocity.step

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1, "momentum": 0.9})


def test_a_documented_name_whose_state_differs_is_said_and_read_from_its_state(
    tmp_path, out_dir, static_mode, caplog
):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _run(tmp_path, SGD)
    lines = [r.getMessage() for r in caplog.records if "mv_distribution" in r.getMessage()]
    assert len(lines) == 1 and "momentum_buffer" in lines[0] and "velocity" in lines[0], lines
    rows = keyed(read_family(monitor.run_dir, "velocity"))
    # from the first step's update on: found in the state after it, as for an unknown optimizer
    assert set(rows) == {(n, s, None) for (k, n, s) in refs if k == "velocity"}
    for (n, s, _), row in rows.items():
        assert_row_matches(row, refs[("velocity", n, s)][0], OPS)


def test_adafactor_factors_are_their_own_rows(tmp_path, out_dir, static_mode):
    monitor, _ = _run(tmp_path, CASES["adafactor"][0])
    rows = keyed(read_family(monitor.run_dir, "row_var"))
    assert rows[("0.weight", 0, None)]["shape"] == "[4, 1]"
    assert keyed(read_family(monitor.run_dir, "col_var"))[("0.weight", 0, None)]["shape"] == "[1, 5]"
    assert set(keyed(read_family(monitor.run_dir, "variance"))) == {
        (n, s, None) for n in ("0.bias", "2.bias") for s in range(STEPS)
    }


@pytest.mark.parametrize(
    "make_opt, when, name",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "set_monitor", "SGD"),  # no momentum: no state
        (lambda ps: Stateless(ps), "first step", "Stateless"),  # unknown, state found empty of tensors
    ],
)
def test_one_warning_when_nothing_matches(tmp_path, out_dir, static_mode, caplog, make_opt, when, name):
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", mv_distribution=True, ops=list(OPS))
    model = nn.Linear(3, 2)
    opt = make_opt(model.parameters())
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        at_attach = [r.getMessage() for r in caplog.records if "mv_distribution" in r.getMessage()]
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    monitor.close()
    lines = [r.getMessage() for r in caplog.records if "mv_distribution" in r.getMessage()]
    assert len(lines) == 1 and name in lines[0] and "Supported" in lines[0] and "momentum_buffer" in lines[0]
    assert bool(at_attach) == (when == "set_monitor")


def test_state_families_are_known_to_the_config():
    from trainermon.collect.records import FAMILIES, STATE_FAMILIES
    from trainermon.runtime.moments import QUALIFIED_KEYS, STATE_KEYS

    # every state key an optimizer can have is a family: Adam's two among FAMILIES, the others' in
    # STATE_FAMILIES, and no STATE_FAMILIES entry that no optimizer has
    assert {"exp_avg", "exp_avg_sq"} <= set(FAMILIES)
    keys = {k for keys in (*STATE_KEYS.values(), *QUALIFIED_KEYS.values()) for k in keys}
    assert keys == set(STATE_FAMILIES) | {"exp_avg", "exp_avg_sq"}
