"""A dropped monitor collected while torch iterates its global optimizer hooks leaves the user's step alone.

The garbage collector runs wherever an allocation triggers it: inside another global optimizer hook (a
profiler's, a user's), or on another thread while the training thread is between two global hooks. A
collected monitor's hooks must then not be removed from torch's hook dicts at once (torch raises
"OrderedDict mutated during iteration" out of the user's optimizer.step()): they stay, inert, until the
next set_monitor or close."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tests.helpers import write_config
from trainermon import TrainerMon
from trainermon.runtime import lifecycle


def _dropped_run(cfg: str) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()  # dropped without close(): freed by the next cyclic collection


@pytest.mark.parametrize("where", ["pre", "post"])
def test_collection_inside_a_global_hook_keeps_the_step(tmp_path, monkeypatch, where):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"])
    lifecycle.settle()
    hooks = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    before = tuple(len(h) for h in hooks)
    register = register_optimizer_step_pre_hook if where == "pre" else register_optimizer_step_post_hook
    collections = []
    # registered first, so torch is iterating its dict (over the monitor's hooks still to come) when it runs
    user_hook = register(lambda opt, args, kwargs: collections.append(gc.collect()))
    enabled = gc.isenabled()
    gc.disable()  # only to make the collection's moment certain (the hook's, not an allocation's)
    try:
        _dropped_run(cfg)
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).square().sum().backward()
        expected = [(p - 0.1 * p.grad).detach().clone() for p in model.parameters()]  # SGD by hand
        collections.clear()
        opt.step()  # the old code: RuntimeError: OrderedDict mutated during iteration
        assert sum(collections) > 0  # the dropped monitor was collected inside torch's iteration
        for p, ref in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), ref)
    finally:
        user_hook.remove()
        if enabled:
            gc.enable()
    gc.collect()
    lifecycle.settle()  # the next set_monitor or close: the dropped monitor's hooks are gone
    assert tuple(len(h) for h in hooks) == before
