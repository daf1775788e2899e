"""A backward that reaches the monitored parameters and is cleared by `zero_grad()` without this optimizer's
`step()` (a GAN's generator loss through the discriminator, FGSM's attack gradient, SAM's first gradient)
is no step: one monitor step per `optimizer.step()`, its rows the gradients that step used (before: each
such backward was closed as an extra step flagged as the loop's own skip, CSV `skipped=2`, so step k of
the optimizer was written as step 2k). Also a step post-hook that raises after a real update (a user's,
registered before set_monitor): its step is not flagged skipped. References: float64 norms of the
gradients each step used, taken in the test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon

ITERATIONS = 4


def _monitor(tmp_path, monkeypatch, **keys) -> TrainerMon:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return TrainerMon(
        write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], ndigits=12, **keys)
    )


def _rows(monitor: TrainerMon, name: str) -> dict[int, tuple[float, str]]:
    rows = [r for r in read_family(monitor.run_dir, "grad_reduced") if r["name"] == name]
    out = {int(r["step"]): (float(r["norm"]), r["skipped"]) for r in rows}
    assert len(out) == len(rows), rows  # one row per step
    return out


def _check(monitor: TrainerMon, name: str, ref: list[float], steps: list[int]) -> None:
    assert monitor.current_step == len(ref), monitor.current_step
    got = _rows(monitor, name)
    assert sorted(got) == steps, got
    for step in steps:
        norm, skipped = got[step]
        assert skipped == "", (step, got)
        assert norm == pytest.approx(ref[step], rel=1e-6), (step, got, ref)
    assert monitor.faults.total == 0, dict(monitor.faults.counts)


def test_a_gan_discriminator_counts_its_own_steps(tmp_path, monkeypatch):
    """PyTorch's DCGAN tutorial loop, monitored on the discriminator: the generator's loss backpropagates
    through it and `netD.zero_grad()` clears that at the top of the next iteration."""
    monitor = _monitor(tmp_path, monkeypatch)
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-3)
    monitor.set_monitor(net_d, optimizer=opt_d)
    bce = nn.BCEWithLogitsLoss()
    ref = []
    for _ in range(ITERATIONS):
        real = torch.randn(8, 4)
        net_d.zero_grad()
        bce(net_d(real), torch.ones(8, 1)).backward()
        fake = net_g(torch.randn(8, 4))
        bce(net_d(fake.detach()), torch.zeros(8, 1)).backward()
        ref.append(net_d[2].weight.grad.double().norm().item())
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), torch.ones(8, 1)).backward()
        opt_g.step()
    monitor.close()
    _check(monitor, "2.weight", ref, list(range(ITERATIONS)))


@pytest.mark.parametrize("interval", [1, 2])
def test_fgsm_adversarial_training_counts_one_step_per_update(tmp_path, monkeypatch, interval):
    """The attack's backward reaches the parameters, `model.zero_grad()` clears it, then the real backward
    and `opt.step()`: the collected rows are the real gradients (before, with step_interval 2, every
    collected row was the attack's)."""
    monitor = _monitor(tmp_path, monkeypatch, step_interval=interval)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.set_monitor(model, optimizer=opt)
    ce = nn.CrossEntropyLoss()
    ref = []
    for _ in range(ITERATIONS):
        x = torch.randn(8, 4).requires_grad_()
        y = torch.randint(0, 2, (8,))
        ce(model(x), y).backward()
        x_adv = (x + 0.1 * x.grad.sign()).detach()
        model.zero_grad()
        ce(model(x_adv), y).backward()
        ref.append(model[2].weight.grad.double().norm().item())
        opt.step()
        opt.zero_grad()
    monitor.close()
    _check(monitor, "2.weight", ref, list(range(0, ITERATIONS, interval)))


class SAM(torch.optim.Optimizer):
    """davda54/sam's SAM, trimmed: `first_step` moves to the adversarial point and clears the gradients,
    `second_step` restores the weights and steps the base optimizer (which shares `param_groups`)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grads = [p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack(grads))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * g["rho"] / (norm + 1e-12))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()


@pytest.mark.parametrize("form", ["closure", "two_calls"])
def test_sam_is_one_step_per_update(tmp_path, monkeypatch, form):
    """SAM monitored as the optimizer: `opt.step(closure)` (its zero_grad inside step()) and the
    first_step/second_step form (the base optimizer, sharing SAM's param_groups, steps them outside
    SAM's step()); rows: the gradients at the adversarial point, which the base optimizer used."""
    monitor = _monitor(tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref: list[float] = []
    opt.base_optimizer.register_step_pre_hook(
        lambda *a: ref.append(model[2].weight.grad.double().norm().item())
    )
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(ITERATIONS):
        x = torch.randn(8, 4)
        model(x).pow(2).mean().backward()
        if form == "closure":
            opt.step(lambda x=x: model(x).pow(2).mean().backward())
            opt.zero_grad()
        else:
            opt.first_step(zero_grad=True)
            model(x).pow(2).mean().backward()
            opt.second_step(zero_grad=True)
    monitor.close()
    assert len(ref) == ITERATIONS
    _check(monitor, "2.weight", ref, list(range(ITERATIONS)))


def test_a_post_hook_raising_after_the_update_is_no_skip(tmp_path, monkeypatch):
    """A user's step post-hook, registered before set_monitor (so it runs before the monitor's), raises
    after the update ran; the loop catches it. The step is its own, not flagged skipped."""
    monitor = _monitor(tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls = [0]

    def boom(*args) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("post-hook failed")

    opt.register_step_post_hook(boom)
    monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(2)
    ref = []
    for _ in range(ITERATIONS + 1):
        model(torch.randn(2, 4, generator=gen)).pow(2).mean().backward()
        ref.append(model[2].weight.grad.double().norm().item())
        try:
            opt.step()
        except RuntimeError:
            pass
        opt.zero_grad()
    monitor.close()
    assert opt.state[model[2].weight]["step"].item() == ITERATIONS + 1  # every update ran
    _check(monitor, "2.weight", ref, list(range(ITERATIONS + 1)))
