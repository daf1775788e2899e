"""Wrappers the monitor puts on user objects, and optimizers wrapped by a framework.

A method the monitor wraps (`zero_grad`, `_optimizer_step_code`, `step`) keeps the original's signature:
accelerate's `AcceleratedOptimizer.zero_grad(set_to_none=True)` passes the argument only when
`inspect.signature(inner.zero_grad)` names it (and raises otherwise), and DCP's `_init_optim_state` calls
`zero_grad(set_to_none=True)` through it. DCP's state initialisation (an lr-0 step on zero gradients)
given a wrapper whose `.optimizer` the hooks see is no training step, whether the module was imported
before `set_monitor` or after it; and one whose step raised leaves no mark on the optimizer's later steps."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


class _Wrapper(torch.optim.Optimizer):
    """A framework's optimizer wrapper with no signature checks, made as accelerate's is (a torch
    Optimizer whose `Optimizer.__init__` never ran): the torch optimizer as `.optimizer`, its state and
    groups shown through."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__, as accelerate
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class _FailsOnce(torch.optim.Adam):
    """Adam whose first step raises after its pre-hooks ran (a state initialisation that fails)."""

    failed = False

    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("state init failed")
        return super().step(closure)


def _wrap(kind: str, model: nn.Module, opt: torch.optim.Optimizer):
    if kind == "plain":
        return model, _Wrapper(opt)
    from accelerate import Accelerator

    return Accelerator(cpu=True).prepare(model, opt)


def _train(model, opt, steps: range, seed: int) -> dict[tuple, dict]:
    gen = torch.Generator().manual_seed(seed)
    grads: dict[tuple, dict] = {}
    for step in steps:
        opt.zero_grad(set_to_none=True)
        model(torch.randn(3, 4, generator=gen)).square().mean().backward()
        for n, p in model.named_parameters():
            grads[(n, step, None)] = ref_stats(p.grad)
        opt.step()
    return grads


def _check_rows(monitor, grads: dict[tuple, dict]) -> None:
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert sorted({k[1] for k in rows}) == sorted({k[1] for k in grads})  # no step added or lost
    assert set(rows) == set(grads)
    for key, row in rows.items():
        assert_row_matches(row, grads[key], OPS)


def test_copysafe_shows_the_original_signature():
    from trainermon.copies import CopySafe

    opt = torch.optim.Adam(_model().parameters())
    wrapped = CopySafe(lambda *args, **kwargs: None, opt.zero_grad)
    assert inspect.signature(wrapped) == inspect.signature(opt.zero_grad)
    assert "set_to_none" in inspect.signature(wrapped).parameters
    assert wrapped.__name__ == "zero_grad" and wrapped.__wrapped__ == opt.zero_grad
    assert not hasattr(wrapped, "__func__")  # torch's LRScheduler would step the original, past the wrapper
    hook = CopySafe(lambda module, args: None)  # a hook: nothing to show
    assert not hasattr(hook, "__wrapped__") and not hasattr(hook, "__name__")


def test_accelerate_zero_grad_set_to_none_monitored(tmp_path, monkeypatch):
    """D4: the monitored inner zero_grad still names `set_to_none`, so accelerate passes it (it raised)."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    reference = torch.optim.Adam(_model().parameters(), lr=1e-2)  # never monitored
    model, opt = _wrap("accelerate", model, torch.optim.Adam(model.parameters(), lr=1e-2))
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    inner = opt.optimizer
    try:
        assert inspect.signature(inner.zero_grad) == inspect.signature(reference.zero_grad)
        assert inspect.signature(inner._optimizer_step_code) == inspect.signature(
            reference._optimizer_step_code
        )
        grads = _train(model, opt, range(3), seed=1)
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())  # passed through, not dropped
    finally:
        monitor.close()
    _check_rows(monitor, grads)


@pytest.mark.parametrize("kind", ["plain", "accelerate"])
def test_dcp_state_init_through_wrapper_is_no_step(tmp_path, monkeypatch, kind):
    """D5: DCP given the wrapper, the hooks seeing the optimizer inside it: steps 2, 3, 4 stay 2, 3, 4."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    model, opt = _wrap(kind, model, torch.optim.Adam(model.parameters(), lr=1e-2))
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=2)
    try:  # closed on a failure too: a monitor left attached keeps DCP's function wrapped for later tests
        dcp_state_dict.get_state_dict(model, opt)  # a resume's state init: one lr-0 step on zero gradients
        assert len(opt.state) == 4  # the state it made
        grads = _train(model, opt, range(2, 5), seed=2)
    finally:
        monitor.close()
    _check_rows(monitor, grads)


@pytest.fixture
def no_monitor_attached(monkeypatch):
    """state_init's process-wide state as in a process where no monitor is attached: earlier tests of the
    suite may leave monitors unclosed (their wrapper of `_init_optim_state` stays), so the late-import
    path is only reached from a clean slate; everything is put back afterwards."""
    from trainermon.adapters import state_init

    original = (
        state_init._installed[0][1] if state_init._installed else getattr(dcp_state_dict, state_init.FUNCTION)
    )
    monkeypatch.setattr(dcp_state_dict, state_init.FUNCTION, original)
    for name, fresh in (("_running", []), ("_stacked", []), ("_installed", []), ("_watchers", [0])):
        monkeypatch.setattr(state_init, name, fresh)
    flags = state_init.maybe[0], state_init.late[0]  # shared by reference with the step hooks
    state_init.maybe[0] = state_init.late[0] = False
    yield state_init
    state_init.maybe[0], state_init.late[0] = flags


@pytest.mark.parametrize("kind", ["bare_fails", "plain", "accelerate"])
def test_dcp_state_init_imported_late(tmp_path, monkeypatch, kind, no_monitor_attached):
    """The DCP module imported after set_monitor (found on the stack at the step): through a wrapper it
    is no step either, and a state-init step that raised marks none of the later steps as no step."""
    from trainermon import TrainerMon

    state_init = no_monitor_attached
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    model = _model()
    if kind == "bare_fails":
        opt = _FailsOnce(model.parameters(), lr=1e-2)
    else:
        model, opt = _wrap(kind, model, torch.optim.Adam(model.parameters(), lr=1e-2))
    monkeypatch.delitem(sys.modules, state_init.MODULE)  # not imported yet at set_monitor
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    assert not state_init._installed
    monkeypatch.setitem(sys.modules, state_init.MODULE, dcp_state_dict)  # imported now
    try:
        if kind == "bare_fails":
            with pytest.raises(RuntimeError, match="state init failed"):
                dcp_state_dict._init_optim_state(opt)
            for group in opt.param_groups:
                group["lr"] = 1e-2  # the raise left lr 0
        else:
            dcp_state_dict._init_optim_state(opt)
            assert len(opt.state) == 4
        assert state_init._installed  # wrapped at that step
        grads = _train(model, opt, range(3), seed=3)
    finally:
        monitor.close()
    assert not state_init._stacked and not state_init._running
    _check_rows(monitor, grads)
