"""Manual mode (`monitor.step()`, no optimizer given): in either order against `zero_grad()` and with
either `set_to_none`, every row written is what its family says (gradients of the backward, parameters
after the update); param_origin and update (which need the parameters before the update) and gradients
cleared before `step()` are absent, each said once. And a collected step's parameter re-scan check:
the adapter's full `new_parameters()` once per collected step, still following a mid-iteration unfreeze."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("order", ["step_monitor_zero", "step_zero_monitor"])
def test_manual_step_writes_only_true_rows(tmp_path, monkeypatch, caplog, order, set_to_none):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, param_distribution=True, update_distribution=True,
        ops=list(OPS), ndigits=12,
    )  # fmt: skip
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)  # not given: manual mode
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor.set_monitor(model, grad_acc_steps=1)
        gen = torch.Generator().manual_seed(1)
        grads: dict[tuple, dict] = {}
        updated: dict[tuple, dict] = {}
        for step in range(STEPS):
            model(torch.randn(3, 4, generator=gen)).square().mean().backward()
            for n, p in model.named_parameters():
                grads[(n, step, None)] = ref_stats(p.grad)
            opt.step()
            for n, p in model.named_parameters():
                updated[(n, step, None)] = ref_stats(p)
            if order == "step_monitor_zero":
                monitor.step()
                opt.zero_grad(set_to_none=set_to_none)
            else:
                opt.zero_grad(set_to_none=set_to_none)
                monitor.step()
        monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    cleared = _messages(caplog, "found no gradients")
    if order == "step_monitor_zero":
        assert set(rows) == set(grads)
        for key, row in rows.items():
            assert_row_matches(row, grads[key], OPS)
        assert cleared == []
    else:  # gradients gone (None) or zeroed in place: no rows rather than zeros
        assert rows == {}
        assert len(cleared) == 1 and ("None" if set_to_none else "zeroed") in cleared[0], cleared
    rows = keyed(read_family(monitor.run_dir, "param_updated"))
    assert set(rows) == set(updated)
    for key, row in rows.items():
        assert_row_matches(row, updated[key], OPS)
    # param_origin would be the updated parameters and update zeros: neither is written, said once
    assert read_family(monitor.run_dir, "param_origin") == []
    assert read_family(monitor.run_dir, "update") == []
    said = _messages(caplog, "no param_origin or update rows in this mode")
    assert len(said) == 1, said

    # set_monitor's line says the order
    assert "after optimizer.step(), before zero_grad()" in " ".join(_messages(caplog, "none hooked"))


def test_manual_step_keeps_rows_read_at_clipping(tmp_path, monkeypatch, caplog):
    """Gradients read at the user's clipping (before it scales them) stand, even when zero_grad() comes
    before step(): only gradients first looked at by step() are judged."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1)
    gen = torch.Generator().manual_seed(2)
    grads: dict[tuple, dict] = {}
    with caplog.at_level(logging.INFO, logger="trainermon"):
        for step in range(STEPS):
            model(torch.randn(3, 4, generator=gen)).square().mean().backward()
            for n, p in model.named_parameters():
                grads[(n, step, None)] = ref_stats(p.grad)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad(set_to_none=False)
            monitor.step()
        monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == set(grads)
    for key, row in rows.items():
        assert_row_matches(row, grads[key], OPS)
    assert _messages(caplog, "found no gradients") == []


@pytest.mark.parametrize("how", ["unfreeze", "replace"])
def test_rescan_check_runs_once_per_collected_step(tmp_path, monkeypatch, how):
    """The adapter's `new_parameters()` (an identity check per module and parameter slot) runs once per
    collected step, not again when the gradients are read; a layer unfrozen, or a parameter replaced,
    during an iteration (after that step's boundary) still has its rows from that step on."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    if how == "unfreeze":
        model[2].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    adapter = monitor.loop.adapter
    original = type(adapter).new_parameters
    calls: dict[int, int] = {}

    def counting(self):
        calls[monitor.loop.step] = calls.get(monitor.loop.step, 0) + 1
        return original(self)

    monkeypatch.setattr(type(adapter), "new_parameters", counting)
    gen = torch.Generator().manual_seed(3)
    grads: dict[tuple, dict] = {}
    thaw = 2
    for step in range(5):
        if step == thaw and how == "unfreeze":  # after this step's boundary (the last opt.step())
            model[2].requires_grad_(True)
        elif step == thaw:  # the same, a new tensor under the same name, in the optimizer too
            old = model[2].weight
            model[2].weight = nn.Parameter(old.detach() * 0.5)
            opt.param_groups[0]["params"] = [
                model[2].weight if p is old else p for p in opt.param_groups[0]["params"]
            ]
        model(torch.randn(3, 4, generator=gen)).square().mean().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[(n, step, None)] = ref_stats(p.grad)
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    # step 0's boundary ran in set_monitor, before the counter; the thaw step asks again at the read
    assert calls == {1: 1, 2: 2, 3: 1, 4: 1, 5: 1}, calls
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == set(grads)
    assert ("2.weight", thaw, None) in rows
    assert (("2.weight", thaw - 1, None) in rows) == (how == "replace")
    for key, row in rows.items():
        assert_row_matches(row, grads[key], OPS)


@pytest.mark.parametrize("edit", ["clip", "scaler"])
def test_manual_step_zero_first_gradient_edited_in_place(tmp_path, monkeypatch, caplog, edit):
    """The first selected parameter's gradient legitimately all zeros (the next layer zero-initialised, as
    LoRA's B) and the gradients edited in place after backward (a hand-written clip, GradScaler.unscale_):
    every step keeps its rows, and nothing is said about cleared gradients. A real in-place clear (all
    zeros) still gives no rows (`test_manual_step_writes_only_true_rows`)."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    with torch.no_grad():
        model[2].weight.zero_()  # model[0]'s gradient is exactly zero at step 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1)
    gen = torch.Generator().manual_seed(3)
    grads: dict[tuple, dict] = {}
    with caplog.at_level(logging.INFO, logger="trainermon"):
        for step in range(STEPS):
            loss = model(torch.randn(3, 4, generator=gen)).square().mean()
            if edit == "scaler":
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(0.5)
            for n, p in model.named_parameters():
                grads[(n, step, None)] = ref_stats(p.grad)
            if edit == "scaler":
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            monitor.step()
            opt.zero_grad()
        monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert grads[("0.weight", 0, None)]["norm"] == 0.0 and grads[("2.weight", 0, None)]["norm"] > 0
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == set(grads)
    for key, row in rows.items():
        assert_row_matches(row, grads[key], OPS)
    assert _messages(caplog, "found no gradients") == []
