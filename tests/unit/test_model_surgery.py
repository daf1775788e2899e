"""The model changed under the monitor, and gradients taken in backward under a loss scaler.

- Module surgery mid-run (`model.head = nn.Linear(8, 5)` or `nn.Identity()` at step 2): from that step the
  `head.*` actv/actv_grad rows are those of the module the model now holds (norms and shapes computed here
  from the live model's tensors), the detached old head keeps no hook (calling it adds no row), and one
  warning names the modules no longer and newly monitored. Before the fix the module list was fixed at
  `set_monitor`: the rows came from the detached head (shape [4, 3]) or were missing, without a word.
- Uncollected steps add no hook to the model (the module-tree check runs on collected steps only).
- With `torch.amp.GradScaler`, `monitor_mbs_grad`'s per-micro-batch `grad_unreduced` rows and `actv_grad`
  are the scaled gradients (scale times the unscaled ones computed here), the step rows unscaled, as the
  README says.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon

STEPS, SWAP_AT = 4, 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head: nn.Module = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


@pytest.fixture(autouse=True)
def _eager_process():
    """These tests count the hooks of eager steps: a graph compiled earlier in this process (another test's
    torch.compile) keeps module hooks installed for good (pinned: compiled code may call them)."""
    import sys

    if "torch._dynamo" in sys.modules:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()


def _hooks(module: nn.Module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


@pytest.mark.parametrize("new_head", [lambda: nn.Linear(8, 5), nn.Identity], ids=["linear", "identity"])
def test_a_replaced_module_is_hooked_and_the_old_one_released(
    tmp_path, out_dir, static_mode, caplog, new_head
):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = write_config(tmp_path / "c.json", targets={}, xy_distribution=True, ops=["norm"], ndigits=17)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    old_head = model.head
    ref: dict[int, tuple[float, list[int], float]] = {}
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for step in range(STEPS):
            if step == SWAP_AT:
                model.head = new_head()
                if list(model.head.parameters()):
                    opt.add_param_group({"params": list(model.head.parameters())})
            out = model(torch.randn(4, 6))
            out.retain_grad()
            if step >= SWAP_AT:
                old_head(torch.randn(4, 8))  # still held (an auxiliary probe): no longer monitored
                assert _hooks(old_head) == 0
            out.pow(2).mean().backward()
            ref[step] = (
                out.detach().double().norm().item(),
                list(out.shape),
                out.grad.double().norm().item(),
            )
            opt.step()
            opt.zero_grad()
    monitor.close()
    assert not dict(monitor.faults.counts)
    actv = keyed(read_family(monitor.run_dir, "actv"))
    grads = keyed(read_family(monitor.run_dir, "actv_grad"))
    for step, (norm, shape, grad_norm) in ref.items():
        row = actv[("head.output", step, 0)]
        assert row["shape"] == str(shape), (step, row["shape"], shape)
        assert math.isclose(float(row["norm"]), norm, rel_tol=1e-6), (step, row["norm"], norm)
        grad = float(grads[("head.output", step, 0)]["norm"])
        assert math.isclose(grad, grad_norm, rel_tol=1e-6), (step, grad, grad_norm)
    assert len([k for k in actv if k[0] == "head.output"]) == STEPS  # none from the detached head
    said = [r.getMessage() for r in caplog.records if "modules changed" in r.getMessage()]
    assert len(said) == 1 and f"step {SWAP_AT}:" in said[0], said
    assert "no longer monitored head;" in said[0] and "newly monitored head" in said[0], said


def test_uncollected_steps_add_no_hook(tmp_path, out_dir, static_mode):
    """step_interval 2: on the uncollected steps the model's modules carry no hook of the monitor's but
    the roots' watchers (the same count as on collected steps once their check ran), and a swap made
    before an uncollected step is picked up at the next collected one."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = write_config(
        tmp_path / "c.json",
        targets={},
        xy_distribution=True,
        forward_only=True,
        ops=["norm"],
        ndigits=17,
        step_interval=2,
    )
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    ref, roots = {}, set()
    for step in range(6):
        if step == 3:  # uncollected
            model.head = nn.Linear(8, 5)
            opt.add_param_group({"params": list(model.head.parameters())})
        seen: list[int] = []
        handle = model.head.register_forward_hook(lambda m, a, o, seen=seen: seen.append(_hooks(model)))
        out = model(torch.randn(4, 6))
        handle.remove()
        if step % 2:
            assert _hooks(model.body) == 0 and _hooks(model.head) == 0, step
        roots.update(seen)  # the roots' watchers only: the collected step's one-shot check is gone by then
        ref[step] = (out.detach().double().norm().item(), str(list(out.shape)))
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert len(roots) == 1, roots
    actv = keyed(read_family(monitor.run_dir, "actv"))
    assert sorted(k[1] for k in actv if k[0] == "head.output") == [0, 2, 4]
    for step in (0, 2, 4):
        row = actv[("head.output", step, 0)]
        assert math.isclose(float(row["norm"]), ref[step][0], rel_tol=1e-6) and row["shape"] == ref[step][1]


def test_scaled_gradients_taken_in_backward(tmp_path, out_dir, static_mode):
    """GradScaler (init_scale 1024), 2 micro-batches: per-micro-batch grad_unreduced and actv_grad are the
    scaled gradients; the step's grad_reduced is the unscaled sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    config = write_config(
        tmp_path / "c.json",
        targets={},
        xy_distribution=True,
        backward_only=True,
        wg_distribution=True,
        monitor_mbs_grad=True,
        ops=["norm"],
        ndigits=17,
    )
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    micro, out_grads = [], []
    for _ in range(2):
        out = model(torch.randn(4, 6))
        out.retain_grad()
        before = model[0].weight.grad.clone() if model[0].weight.grad is not None else 0
        scaler.scale(out.pow(2).mean()).backward()
        micro.append((model[0].weight.grad - before).double() / 1024.0)
        out_grads.append(out.grad.double() / 1024.0)
    total = model[0].weight.grad.double() / 1024.0
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    monitor.close()
    assert not dict(monitor.faults.counts)
    unreduced = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    for m, g in enumerate(micro):
        got = float(unreduced[("0.weight", 0, m)]["norm"])
        assert math.isclose(got, 1024.0 * g.norm().item(), rel_tol=1e-6), (m, got)
    actv_grad = keyed(read_family(monitor.run_dir, "actv_grad"))
    for m, g in enumerate(out_grads):
        got = float(actv_grad[("0.output", 0, m)]["norm"])
        assert math.isclose(got, 1024.0 * g.norm().item(), rel_tol=1e-6), (m, got)
    reduced = {r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "grad_reduced")}
    assert math.isclose(reduced["0.weight"], total.norm().item(), rel_tol=1e-6)
