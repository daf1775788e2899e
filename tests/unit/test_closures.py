"""Optimizers that take a closure, in PyTorch's documented LBFGS form: the closure calls zero_grad() and
backward() itself, step() calls it several times, and it is passed positionally (`opt.step(closure)`)
or by keyword (Lightning's form). Rows are checked against float64 references the test takes itself."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(model: nn.Module, positional: bool, monitor: TrainerMon | None = None) -> dict:
    """LBFGS steps; per step: the gradients after the closure's first call (what the monitor must read:
    the step's gradients exist only then), the parameters before and after, and the closure's calls."""
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    if monitor is not None:
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    seen: dict = {"grads": [], "before": [], "after": [], "calls": []}
    for _ in range(STEPS):
        calls = [0]
        seen["before"].append({n: p.detach().double() for n, p in model.named_parameters()})

        def closure(calls: list[int] = calls) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            if calls[0] == 0:
                seen["grads"].append({n: p.grad.detach().double() for n, p in model.named_parameters()})
            calls[0] += 1
            return loss

        opt.step(closure) if positional else opt.step(closure=closure)
        seen["calls"].append(calls[0])
        seen["after"].append({n: p.detach().double() for n, p in model.named_parameters()})
    return seen


def _norms(run_dir: str, family: str) -> dict[tuple[int, str], float]:
    rows = read_family(run_dir, family)
    assert all(r["skipped"] in ("", "0") for r in rows), [r for r in rows if r["skipped"] not in ("", "0")]
    keys = [(int(r["step"]), r["name"]) for r in rows]
    assert len(keys) == len(set(keys)), keys  # one row per parameter and step
    return {(int(r["step"]), r["name"]): float(r["norm"]) for r in rows}


@pytest.mark.parametrize("positional", [True, False], ids=["step(closure)", "step(closure=closure)"])
def test_lbfgs_closure_steps_are_one_step_each(tmp_path, monkeypatch, caplog, positional):
    """A positional closure was never wrapped (torch passes the optimizer as args[0]), so gradients were
    read before it ran: none at step 0, the previous step's last closure after that. And each closure's
    zero_grad() after a backward was taken for a GradScaler-skipped step: 4 LBFGS steps became 12."""
    reference = _train(_model(), positional)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "param_distribution": True, "ops": ["norm"], "ndigits": 17}
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", **cfg))
    model = _model()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        got = _train(model, positional, monitor)
        monitor.close()
    assert not [r.getMessage() for r in caplog.records], [r.getMessage() for r in caplog.records]
    assert min(got["calls"]) >= 2, got["calls"]  # several closure calls per step: the case at hand
    for step in range(STEPS):  # the monitor changes nothing
        for name, value in reference["after"][step].items():
            assert torch.equal(got["after"][step][name], value), (step, name)
    grads = _norms(monitor.run_dir, "grad_reduced")
    origin = _norms(monitor.run_dir, "param_origin")
    updated = _norms(monitor.run_dir, "param_updated")
    names = [n for n, _ in model.named_parameters()]
    assert set(grads) == set(origin) == set(updated) == {(s, n) for s in range(STEPS) for n in names}
    for step in range(STEPS):
        for name in names:
            # float32 elements summed in float32 over <= 12 terms: well within 1e-5 relative
            want = float(got["grads"][step][name].norm())
            assert math.isclose(grads[step, name], want, rel_tol=1e-5), (step, name, grads[step, name], want)
            want = float(got["before"][step][name].norm())
            assert math.isclose(origin[step, name], want, rel_tol=1e-5), (step, name)
            want = float(got["after"][step][name].norm())
            assert math.isclose(updated[step, name], want, rel_tol=1e-5), (step, name)


def test_parameters_of_a_second_optimizer_are_named_once(tmp_path, monkeypatch, caplog):
    """The monitored optimizer's step is where param rows are read: a parameter that another optimizer
    updates shows param_updated == param_origin and no state rows, which is said, once."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "head": nn.Linear(4, 2)})
    dense = torch.optim.Adam(model["head"].parameters())
    sparse = torch.optim.SparseAdam(model["emb"].parameters())
    cfg = {"param_distribution": True, "mv_distribution": True, "ops": ["norm"]}
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", **cfg))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=dense)
        for _ in range(2):
            model["head"](model["emb"](torch.tensor([1, 2, 3]))).sum().backward()
            dense.step()
            sparse.step()
            dense.zero_grad()
            sparse.zero_grad()
        monitor.close()
    said = [r.getMessage() for r in caplog.records if "not in the monitored optimizer" in r.getMessage()]
    assert len(said) == 1 and "1 trainable parameters" in said[0] and "(emb.weight)" in said[0], said


def test_a_step_that_raises_leaves_skip_detection_on(tmp_path, monkeypatch):
    """torch runs no step post-hook when step() raises: a flag set for the whole step() stayed set and
    hid every later GradScaler skip (iterations 1-3 merged into one step, the overflow lost)."""

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    calls = [0]

    def fail_second_step(optimizer, args, kwargs):  # after the monitor's own pre-hooks: step() raises
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("out of memory (simulated)")

    opt.register_step_pre_hook(fail_second_step)
    gen = torch.Generator().manual_seed(1)
    for iteration in range(5):
        loss = model(torch.randn(4, 4, generator=gen)).pow(2).mean()
        if iteration == 2:
            loss = loss * math.inf  # the scaler finds inf gradients and skips this step
        scaler.scale(loss).backward()
        try:
            scaler.step(opt)
        except RuntimeError:
            pass  # the loop goes on, as a job that retries a batch does
        scaler.update()
        opt.zero_grad()
    monitor.close()
    flags = sorted({(int(r["step"]), r["skipped"]) for r in read_family(monitor.run_dir, "grad_reduced")})
    # iteration 1's step raised (no update: a skipped step), iteration 2 overflowed (skipped)
    assert flags == [(0, ""), (1, "1"), (2, "1"), (3, ""), (4, "")], flags


@pytest.mark.parametrize("with_closure", [False, True], ids=["step()", "step(closure)"])
def test_a_step_calling_super_step_is_one_step(tmp_path, monkeypatch, with_closure):
    """torch wraps the `step` of the class of every optimizer made. Once an SGD exists, a subclass whose
    step() calls super().step() runs each step hook twice, nested: each iteration counted as two steps
    (step 1's rows were iteration 0's second half). A step() that raises (iteration 1) runs no post-hook:
    the nesting check must not depend on one. With a closure, that step ran no closure: no gradients, no
    step; without, its gradients exist and it is a step without an update (flagged skipped)."""

    class Clipped(torch.optim.SGD):
        fail_next = False

        def step(self, closure=None):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("simulated failure inside step()")
            return super().step(closure)

    torch.optim.SGD(nn.Linear(1, 1).parameters())  # makes torch wrap SGD.step, whatever ran before
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = _model()
    opt = Clipped(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "param_distribution": True, "ops": ["norm"], "ndigits": 17}
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", **cfg))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    grads, after = [], []
    for iteration in range(4):
        x = torch.randn(5, 4, generator=gen)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            return loss

        if not with_closure:
            closure()
        opt.fail_next = iteration == 1
        try:
            opt.step(closure) if with_closure else opt.step()
        except RuntimeError:
            pass
        if not (with_closure and iteration == 1):
            grads.append({n: float(p.grad.double().norm()) for n, p in model.named_parameters()})
            after.append({n: float(p.detach().double().norm()) for n, p in model.named_parameters()})
        opt.zero_grad()
    monitor.close()
    rows = read_family(monitor.run_dir, "grad_reduced")
    flags = sorted({(int(r["step"]), r["skipped"]) for r in rows})
    # the raising step() skipped the update with no loss scaler: the loop's own skip (CSV 2)
    assert flags == ([(0, ""), (1, ""), (2, "")] if with_closure else [(0, ""), (1, "2"), (2, ""), (3, "")])
    names = sorted(n for n, _ in model.named_parameters())
    assert sorted((int(r["step"]), r["name"]) for r in rows) == [(s, n) for s, _ in flags for n in names]
    param_rows = read_family(monitor.run_dir, "param_updated")
    updated = {(int(r["step"]), r["name"]): float(r["norm"]) for r in param_rows}
    for row in rows:  # float32 sums of <= 12 terms: well within 1e-5 relative
        step, name = int(row["step"]), row["name"]
        assert math.isclose(float(row["norm"]), grads[step][name], rel_tol=1e-5), (step, name)
        if with_closure or step != 1:
            assert math.isclose(updated[step, name], after[step][name], rel_tol=1e-5), (step, name)
