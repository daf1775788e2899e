"""mv_distribution's state keys follow the param groups: a group added after set_monitor (add_param_group)
or hyperparameters restored by load_state_dict that make a new key (SGD momentum, Adam amsgrad) get rows,
said once at INFO. They used to be fixed at set_monitor: no rows, no word. Parameter-shaped state tensors
under other keys (an Adam subclass's `ema`, an unknown optimizer's key made at its second step) are named
once in a warning. Values against the optimizer's own state, float64, read in the test."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
STEPS = 3


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _checkpoint(make_opt) -> dict:
    model = _net()
    opt = make_opt(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return copy.deepcopy(opt.state_dict())


def _run(tmp_path, make_opt, after_set_monitor=lambda model, opt: None):
    """STEPS monitored steps; returns the monitor and {(key, name, step): float64 stats of the state}."""
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", mv_distribution=True, ops=list(OPS), ndigits=12)
    model = _net()
    opt = make_opt(model)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    after_set_monitor(model, opt)
    refs: dict = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        opt.zero_grad()
        (model(torch.randn(5, 4, generator=gen)) - torch.randn(5, 3, generator=gen)).pow(2).mean().backward()
        opt.step()
        for name, p in model.named_parameters():
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor) and value.dim():
                    refs[(key, name, step)] = ref_stats(value)
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    return monitor, refs


def _add_group(hyper: dict):
    def add(model, opt):
        opt.add_param_group({"params": list(model[2].parameters()), **hyper})

    return add


def _load(ckpt_opt):
    ckpt = _checkpoint(ckpt_opt)

    def load(model, opt):
        opt.load_state_dict(copy.deepcopy(ckpt))

    return load


CASES = {
    # progressive unfreezing: SGD without momentum at set_monitor, a momentum group added
    "sgd_add_momentum_group": (
        lambda m: torch.optim.SGD(m[0].parameters(), lr=0.1),
        _add_group({"momentum": 0.9}),
        "momentum_buffer",
        6,
    ),
    "adam_add_amsgrad_group": (
        lambda m: torch.optim.Adam(m[0].parameters(), lr=0.1),
        _add_group({"amsgrad": True}),
        "max_exp_avg_sq",
        6,
    ),
    # resume: built with defaults, a checkpoint's hyperparameters loaded after set_monitor
    "adam_resume_amsgrad": (
        lambda m: torch.optim.Adam(m.parameters(), lr=0.1),
        _load(lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True)),
        "max_exp_avg_sq",
        12,
    ),
    "sgd_resume_momentum": (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        _load(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        "momentum_buffer",
        12,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_keys_made_by_changed_param_groups_get_rows(tmp_path, out_dir, static_mode, caplog, case):
    make_opt, change, key, count = CASES[case]
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor, refs = _run(tmp_path, make_opt, change)
    want = {(n, s, None) for (k, n, s) in refs if k == key}
    assert len(want) == count
    rows = keyed(read_family(monitor.run_dir, key))
    assert set(rows) == want, sorted(set(rows) ^ want)
    for (n, s, _), row in rows.items():
        assert_row_matches(row, refs[(key, n, s)], OPS)
    # every other state key the optimizer holds keeps its rows
    for other in {k for (k, _, _) in refs} - {key}:
        assert set(keyed(read_family(monitor.run_dir, other))) == {
            (n, s, None) for (k, n, s) in refs if k == other
        }, other
    changed = [r for r in caplog.records if "param groups of" in r.getMessage()]
    assert len(changed) == 1 and changed[0].levelno == logging.INFO
    now = changed[0].getMessage().split("are now ")[1].split(" (were")[0].split("/")
    assert key in now, now
    unwritten = [r.getMessage() for r in caplog.records if "get no rows" in r.getMessage()]
    assert unwritten == []


class AdamEMA(torch.optim.Adam):
    """Adam that also keeps an EMA of the weights in its state (parameter-shaped, not a documented key)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["ema"] = p.detach().clone() if "ema" not in st else st["ema"].mul_(0.9).add_(p, alpha=0.1)
        return out


class Lazy(torch.optim.Optimizer):
    """Unknown to trainermon: `buf` from its first step, `slow` (lookahead weights) from its second."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                st.setdefault("buf", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                p.add_(st["buf"], alpha=-group["lr"])
                if st["n"] >= 2:
                    st["slow"] = p.detach().clone() if "slow" not in st else st["slow"].lerp_(p, 0.5)


@pytest.mark.parametrize(
    "make_opt, written, extra",
    [
        (lambda m: AdamEMA(m.parameters(), lr=0.01), ("exp_avg", "exp_avg_sq"), "ema"),
        (lambda m: Lazy(m.parameters()), ("buf",), "slow"),
    ],
    ids=["adam_subclass_ema", "unknown_key_at_second_step"],
)
def test_unwritten_parameter_shaped_state_is_named_once(
    tmp_path, out_dir, static_mode, caplog, make_opt, written, extra
):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, refs = _run(tmp_path, make_opt)
    said = [r.getMessage() for r in caplog.records if "get no rows" in r.getMessage()]
    assert len(said) == 1 and f"under {extra}," in said[0], said
    assert any(k == extra for (k, _, _) in refs)  # the optimizer does hold it
    assert not read_family(monitor.run_dir, extra)
    for key in written:  # the chosen keys stay right
        rows = keyed(read_family(monitor.run_dir, key))
        assert set(rows) == {(n, s, None) for (k, n, s) in refs if k == key}, key
        for (n, s, _), row in rows.items():
            assert_row_matches(row, refs[(key, n, s)], OPS)


def test_lbfgs_is_said_to_keep_no_per_parameter_state(tmp_path, out_dir, static_mode, caplog):
    from trainermon import TrainerMon

    cfg = write_config(tmp_path / "cfg.json", mv_distribution=True, ops=list(OPS))
    model = _net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        x, y = torch.randn(5, 4), torch.randn(5, 3)

        def closure():
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(2):
            opt.step(closure)
    monitor.close()
    assert opt.state[next(model.parameters())]  # it does keep state: flat, under its first parameter
    said = [r.getMessage() for r in caplog.records if "mv_distribution" in r.getMessage()]
    assert len(said) == 1 and "LBFGS keeps no per-parameter state" in said[0], said


def _zero_amsgrad_group(rank: int, world: int, out_root: str) -> dict:
    """ZeroRedundancyOptimizer(Adam) over the first layer; a group with amsgrad added after set_monitor."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "out")
    cfg = write_config(Path(out_root) / f"cfg{rank}.json", mv_distribution=True, ops=list(OPS), ndigits=12)
    model = _net()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DDP(model)
    zro = ZeroRedundancyOptimizer(list(model[0].parameters()), optimizer_class=torch.optim.Adam, lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, optimizer=zro)
    zro.add_param_group({"params": list(model[2].parameters()), "amsgrad": True})
    gen = torch.Generator().manual_seed(100 + rank)
    want: dict = {}
    for step in range(STEPS):
        ddp(torch.randn(5, 4, generator=gen)).pow(2).mean().backward()
        zro.step()
        zro.zero_grad()
        mine = {
            (key, names[id(p)], step): ref_stats(value)
            for p, st in zro.optim.state.items()
            for key, value in st.items()
            if isinstance(value, torch.Tensor) and value.dim()
        }
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)  # each parameter's state is on its owner only
        for part in gathered:
            want.update(part)
    monitor.close()
    rows = {k: keyed(read_family(monitor.run_dir, k)) for k in ("exp_avg", "max_exp_avg_sq")}
    return {"rows": rows, "want": want, "faults": monitor.faults.total}


def test_zero_redundancy_amsgrad_group_added_gets_rows_on_two_ranks(tmp_path):
    """The keys are decided again from the hyperparameters, alike on both ranks: the packed merge stays
    aligned and the writer (rank 0) writes every owner's max_exp_avg_sq."""
    results = run_ranks(_zero_amsgrad_group, world_size=2, out_root=str(tmp_path))
    assert [r["faults"] for r in results] == [0, 0]
    want = results[0]["want"]
    for key in ("exp_avg", "max_exp_avg_sq"):
        refs = {(n, s, None): v for (k, n, s), v in want.items() if k == key}
        assert len(refs) == (12 if key == "exp_avg" else 6)
        rows = results[0]["rows"][key]
        assert set(rows) == set(refs), (key, sorted(set(rows) ^ set(refs)))
        for k, row in rows.items():
            assert_row_matches(row, refs[k], OPS)
        assert results[1]["rows"][key] == {}  # written once, by rank 0
