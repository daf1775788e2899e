"""set_monitor on models it could not take before: a model with lazy modules (`nn.LazyLinear`: its
parameters uninitialized until the first forward; before, set_monitor raised torch's ValueError from
`register_post_accumulate_grad_hook`), and a TorchScript module (before: AttributeError from inside the
unwrapping; now a TypeError that names ScriptModule and says to monitor the eager module)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon

STEPS = 3


def _train(monitor: TrainerMon | None) -> tuple[list[float], list[dict[str, float]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if monitor is not None:
        monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for step in range(STEPS):
        loss = model(torch.randn(2, 4, generator=gen)).pow(2).mean()
        if step == 1:
            loss = loss * float("nan")  # the loop skips this step itself: still its own step
        loss.backward()
        grads.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def test_a_lazy_model_trains_monitored(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    ref_losses, ref_grads = _train(None)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], ndigits=12))
    losses, grads = _train(monitor)
    monitor.close()
    assert losses[0] == ref_losses[0] and losses[2] == ref_losses[2]  # the monitor changes nothing
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert monitor.current_step == STEPS
    rows = {(int(r["step"]), r["name"]): r for r in read_family(monitor.run_dir, "grad_reduced")}
    names = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {s for s, _ in rows} == set(range(STEPS)), sorted(rows)
    for step in (0, 2):
        for name in names:
            row = rows[(step, name)]
            assert float(row["norm"]) == pytest.approx(grads[step][name], rel=1e-6), (step, name)
            assert row["skipped"] == ""
    # The NaN step: its own step, flagged as the loop's skip (the lazy parameters are hooked by then)
    assert {rows[(1, n)]["skipped"] for n in names} == {"2"}


def test_a_scripted_model_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.jit.script(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"]))
    with pytest.raises(TypeError, match="ScriptModule") as info:
        monitor.set_monitor(model, optimizer=opt)
    assert "eager" in str(info.value)
    monitor.close()


def test_a_probe_that_cannot_attach_is_one_fault(tmp_path, monkeypatch):
    """Each probe's attach is guarded: one that raises (any model it cannot take) is one counted fault,
    and set_monitor and the other probes go on (before: the error left set_monitor)."""
    from trainermon.runtime.skips import SkippedStepProbe

    def fail(self):
        raise RuntimeError("cannot attach (injected)")

    monkeypatch.setattr(SkippedStepProbe, "attach", fail)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], ndigits=12))
    monitor.set_monitor(model, optimizer=opt)
    ref = []
    for _ in range(STEPS):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        ref.append(model[2].weight.grad.double().norm().item())
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert dict(monitor.faults.counts) == {"attaching SkippedStepProbe": 1}
    rows = {
        int(r["step"]): float(r["norm"])
        for r in read_family(monitor.run_dir, "grad_reduced")
        if r["name"] == "2.weight"
    }
    assert rows == pytest.approx(dict(enumerate(ref)), rel=1e-6)


def test_an_eager_model_with_a_scripted_submodule_is_monitored(tmp_path, monkeypatch):
    """Only a scripted model handed to set_monitor is refused: a scripted submodule of an eager model is
    no wrapper (the wrapper check once unwrapped it, and raised), and the rest is monitored."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), torch.jit.script(nn.Sequential(nn.Tanh())), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, xy_distribution=True, ops=["norm"])
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    want = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    opt.step()
    monitor.close()
    rows = {r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "grad_reduced")}
    assert set(rows) == set(want), rows
    for name, norm in want.items():
        assert rows[name] == pytest.approx(norm, rel=1e-6), name
    assert read_family(monitor.run_dir, "actv"), "activations of the eager modules"
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
