"""Parameters frozen (`requires_grad=False`) after `set_monitor`, as Lightning's `toggle_optimizer` and
plain loops do, with `monitor_mbs_grad`: every step keeps its number, a parameter has micro-batch rows
exactly in the steps where it gets a gradient, each equal to that micro-batch's own gradient, and nothing
is counted as a fault. Also: one probe's `begin` failing leaves the other probes' and the step counter
alone (one fault per failure, logged once)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime import probes

MICRO = 2
# Whether layer `2` (the last Linear) is frozen during each iteration, switched at the iteration's top:
# after the step boundary, as Lightning's toggle_optimizer inside training_step. Step 1 starts trainable
# and freezes; step 2 starts and stays frozen; steps 3 and 6 start frozen and are unfrozen before their
# forward (untoggle_optimizer); step 5 freezes again.
FROZEN = [False, True, True, False, False, True, False]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(monitor: TrainerMon, frozen: list[bool], unfreeze_at_boundary: bool = False) -> dict:
    """SGD over all parameters, MICRO backwards a step; returns each micro-batch's own gradient (the
    difference of `.grad` around its backward, float64) and each step's `.grad` at the step."""
    model = _model()
    last = model[2]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if unfreeze_at_boundary:
        last.requires_grad_(False)  # frozen at set_monitor: not monitored until it trains
    monitor.set_monitor(model, grad_acc_steps=MICRO, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    seen: dict = {"micro": {}, "reduced": {}, "steps": [], "model": model}
    for step, freeze in enumerate(frozen):
        if not unfreeze_at_boundary:
            last.requires_grad_(not freeze)
        for micro in range(MICRO):
            before = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
            model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
            for n, p in model.named_parameters():
                if p.grad is not None and p.requires_grad:
                    seen["micro"][(step, micro, n)] = p.grad.double() - before.get(n, 0.0)
        for n, p in model.named_parameters():
            if p.grad is not None:
                seen["reduced"][(step, n)] = p.grad.double().clone()
        if unfreeze_at_boundary:
            # before the update, so at the boundary: the next iteration's state
            last.requires_grad_(not frozen[min(step + 1, len(frozen) - 1)])
        opt.step()
        seen["steps"].append(monitor.loop.step)
        opt.zero_grad()
    monitor.close()
    return seen


def _norms(run_dir: str, family: str) -> dict[tuple, float]:
    out = {}
    for r in read_family(run_dir, family):
        assert r["skipped"] in ("", "0"), r
        key = (
            (int(r["step"]), int(r["micro_step"]), r["name"])
            if "micro_step" in r
            else (int(r["step"]), r["name"])
        )
        assert key not in out, key
        out[key] = float(r["norm"])
    return out


def _config(tmp_path, **extra) -> str:
    keys = {"wg_distribution": True, "monitor_mbs_grad": True, "ops": ["norm"], "ndigits": 12, **extra}
    return write_config(tmp_path / "config.json", **keys)


def _assert_rows(run_dir: str, seen: dict) -> None:
    micro = _norms(run_dir, "grad_unreduced")
    want = {k: float(g.norm()) for k, g in seen["micro"].items()}
    assert sorted(micro) == sorted(want)
    for key, norm in want.items():
        assert math.isclose(micro[key], norm, rel_tol=1e-5, abs_tol=1e-9), (key, micro[key], norm)
    reduced = _norms(run_dir, "grad_reduced")
    want = {k: float(g.norm()) for k, g in seen["reduced"].items()}
    assert sorted(reduced) == sorted(want)
    for key, norm in want.items():
        assert math.isclose(reduced[key], norm, rel_tol=1e-5, abs_tol=1e-9), (key, reduced[key], norm)


def test_a_parameter_frozen_and_unfrozen_during_steps(tmp_path, out_dir, static_mode):
    monitor = TrainerMon(_config(tmp_path))
    seen = _train(monitor, FROZEN)
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert seen["steps"] == list(range(1, len(FROZEN) + 1))
    _assert_rows(monitor.run_dir, seen)
    frozen_steps = {s for s, _, n in _norms(monitor.run_dir, "grad_unreduced") if n == "2.weight"}
    assert frozen_steps == {s for s, f in enumerate(FROZEN) if not f}  # unfrozen mid-step (3, 6) included
    assert all(not p._backward_hooks for p in seen["model"].parameters())  # closed: no hook left


def test_a_parameter_frozen_at_set_monitor_unfrozen_and_frozen_again_at_boundaries(
    tmp_path, out_dir, static_mode, caplog
):
    caplog.set_level(logging.INFO, logger="trainermon")
    monitor = TrainerMon(_config(tmp_path))
    # switched before each update, so at the step boundaries: it joins at step 1, is frozen across
    # step 3 and trains again from step 4
    frozen = [True, False, False, True, False, False]
    seen = _train(monitor, frozen, unfreeze_at_boundary=True)
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert seen["steps"] == [1, 2, 3, 4, 5, 6]
    _assert_rows(monitor.run_dir, seen)
    assert {s for s, _, n in _norms(monitor.run_dir, "grad_unreduced") if n == "2.weight"} == {1, 2, 4, 5}
    assert "became trainable" in caplog.text


@pytest.mark.parametrize("failing", ["ActivationProbe", "OptimizerProbe"])
def test_one_probe_failing_in_begin_leaves_the_others_and_the_step_count(
    tmp_path, out_dir, static_mode, monkeypatch, caplog, failing
):
    """A probe whose `begin` raises at every step boundary after the first: the probes after it still
    begin (the skipped-step probe among them: no extra step at zero_grad), one fault per boundary, one
    log line; the other probes' rows are all there and right."""
    original = getattr(probes, failing).begin
    calls = [0]

    def begin(self, plan):
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("probe begin broke")
        return original(self, plan)

    monkeypatch.setattr(getattr(probes, failing), "begin", begin)
    monitor = TrainerMon(_config(tmp_path, xy_distribution=True))
    steps = [False] * 4
    seen = _train(monitor, steps)
    assert seen["steps"] == [1, 2, 3, 4]
    assert dict(monitor.faults.counts) == {"begin step": len(steps)}
    assert len([r for r in caplog.records if "probe begin broke" in r.getMessage()]) == 1  # logged once
    _assert_rows(monitor.run_dir, seen)
    assert {int(r["step"]) for r in read_family(monitor.run_dir, "grad_reduced")} == set(range(len(steps)))


def test_taps_an_adapter_left_behind_when_failing_report_nothing_later(
    tmp_path, out_dir, static_mode, monkeypatch
):
    """An adapter whose `install_microbatch_taps` registers its hooks and then raises (their handles lost
    with the exception): one fault per step, and those hooks feed no later step (no stale micro-steps)."""
    from trainermon.adapters.base import Adapter

    original = Adapter.install_microbatch_taps

    def install(self, params, taps):
        original(self, params, taps)
        raise RuntimeError("install broke")

    monkeypatch.setattr(Adapter, "install_microbatch_taps", install)
    monitor = TrainerMon(_config(tmp_path))
    seen = _train(monitor, [False] * 4)
    assert seen["steps"] == [1, 2, 3, 4]
    assert dict(monitor.faults.counts) == {"begin step": 5}  # the 4 boundaries and attach's
    _assert_rows(monitor.run_dir, seen)


def test_a_compiled_model_that_skips_the_late_tap_says_so(tmp_path, out_dir, static_mode, caplog):
    """torch.compile ignores forward hooks added after compiling (dynamo's default
    skip_nnmodule_hook_guards): a parameter unfrozen before its forward (steps 3 and 6) lost its micro-batch
    rows without a word. Now the loss is said once, naming it; a torch that runs the late hook writes the
    rows instead, and then nothing is said."""
    model = _model()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(_config(tmp_path))
    monitor.set_monitor(compiled, grad_acc_steps=MICRO, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for freeze in FROZEN:
            model[2].requires_grad_(not freeze)
            for _ in range(MICRO):
                compiled(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    got = {(s, m) for s, m, n in _norms(monitor.run_dir, "grad_unreduced") if n == "2.weight"}
    want = {(s, m) for s, f in enumerate(FROZEN) if not f for m in range(MICRO)}
    said = [r for r in caplog.records if "no forward of their module ran trainermon's hook" in r.getMessage()]
    assert monitor.faults.total == 0
    if got == want:
        assert not said
    else:
        assert got == want - {(s, m) for s in (3, 6) for m in range(MICRO)}, sorted(got)
        assert len(said) == 1 and "2.weight" in said[0].getMessage()
