"""A user's hooks registered after the monitor's: a forward pre-hook that replaces an input, a forward hook
that replaces the output. Each actv_grad row must be the gradient of the tensor its actv row is taken
from: for an input, the tensor forward received (after every pre-hook); for an output, the tensor the
monitor's forward hook saw. References: tensor hooks the module's own forward puts on what it received and
what it returned, and torch's full backward hook (msprobe's way: the gradient of the received inputs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon

STEPS = 3  # step 0: no user hook; step 1: the first call after it was added; step 2: a later call


class Block(nn.Module):
    """Two inputs; records what forward received and returned, and their gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * y
        for key, t in (("x", x), ("y", y), ("out", out)):
            self.seen[key] = t.detach().clone()
            t.register_hook(lambda g, key=key: self.seen.__setitem__(f"{key}_grad", g.clone()))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = Block()
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h, h.tanh()))


def _run(tmp_path, late: str) -> tuple[dict, dict, list[dict], list]:
    torch.manual_seed(0)
    model = Net()
    cfg = write_config(
        tmp_path / "c.json", xy_distribution=True, ops=["norm", "max"], format="csv", ndigits=12
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    refs, torch_grads = [], []
    for step in range(STEPS):
        if step == 1 and late == "pre":  # rescales the second input, after the monitor's pre-hook
            model.b.register_forward_pre_hook(lambda mod, args: (args[0], args[1] * 3))
            model.b.register_forward_pre_hook(lambda mod, args: None)  # looks only: keeps what it got
            model.b.register_full_backward_hook(lambda mod, gi, go: torch_grads.append(gi[1].clone()))
        if step == 1 and late == "forward":  # replaces the output, after the monitor's forward hook
            model.b.register_forward_hook(lambda mod, args, out: out * 3)
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        refs.append(dict(model.b.seen))
    monitor.close()
    return (
        keyed(read_family(monitor.run_dir, "actv")),
        keyed(read_family(monitor.run_dir, "actv_grad")),
        refs,
        torch_grads,
    )


def _check(rows: dict, name: str, step: int, ref: torch.Tensor) -> None:
    row = rows[(name, step, 0)]
    assert float(row["norm"]) == pytest.approx(ref.double().norm().item(), rel=1e-5), (name, step)
    assert float(row["max"]) == pytest.approx(ref.double().max().item(), rel=1e-5, abs=1e-7), (name, step)


@pytest.mark.parametrize("pinned", [False, True])
def test_late_forward_pre_hook_input_rows(tmp_path, out_dir, static_mode, pinned):
    """`pinned`: a graph compiled earlier in the process pins the hooks (compiled code may call them), so
    the eager model's hooks take the pinned path; a review found the late-hook check skipped there (the
    rows 3x too big on every step)."""
    if pinned:
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))
    actv, grads, refs, torch_grads = _run(tmp_path, "pre")
    for step in range(STEPS):
        for i, key in enumerate(("x", "y")):
            _check(actv, f"b.input_{i}", step, refs[step][key])
            if step == 1:  # the call that found the hook: no input-gradient rows (never a wrong one)
                assert (f"b.input_{i}", step, 0) not in grads
                continue
            _check(grads, f"b.input_{i}", step, refs[step][f"{key}_grad"])
    _check(grads, "b.output", 1, refs[1]["out_grad"])
    # torch's full backward hook agrees: the gradient of the received (rescaled) input
    for step, grad in zip((1, 2), torch_grads):
        assert torch.allclose(grad, refs[step]["y_grad"], rtol=1e-6, atol=0)
    assert len(torch_grads) == 2


def test_late_forward_hook_output_rows(tmp_path, out_dir, static_mode):
    actv, grads, refs, _ = _run(tmp_path, "forward")
    for step in range(STEPS):  # the output the monitor's hook saw, and that tensor's gradient
        _check(actv, "b.output", step, refs[step]["out"])
        _check(grads, "b.output", step, refs[step]["out_grad"])
        _check(grads, "b.input_1", step, refs[step]["y_grad"])


class Plain(nn.Module):
    """`Block` without the recording (dynamo traces its forward whole: the traced hooks' path)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * y


def _compiled_run(out_dir, tmp_path, when: str, compiled: bool) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = Net()
    model.b = Plain()
    rescale = lambda mod, args: (args[0], args[1] * 3)  # noqa: E731
    received: list = []  # torch's full backward hook: the gradients of the inputs forward received
    run = model
    monitor = None
    if compiled:
        cfg = write_config(tmp_path / "c.json", xy_distribution=True, ops=["norm"], format="csv", ndigits=12)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=None)
        run = torch.compile(model, backend="aot_eager")
    else:
        model.b.register_full_backward_hook(lambda mod, gi, go: received.append([g.clone() for g in gi]))
    look = lambda mod, args: None  # noqa: E731 - changes nothing
    if when == "before":
        model.b.register_forward_pre_hook(rescale)
    for step in range(STEPS):
        if step == 1 and when == "after":  # once traced: a hook that only looks keeps every row right
            model.b.register_forward_pre_hook(look)
        run(torch.randn(3, 4)).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        if monitor is not None:
            monitor.step()
    if monitor is None:
        return {}, received
    monitor.close()
    return keyed(read_family(monitor.run_dir, "actv_grad")), received


@pytest.mark.parametrize("when", ["before", "after"])
def test_late_pre_hook_compiled(tmp_path, out_dir, static_mode, when):
    """Registered after set_monitor and before the first compiled forward: the monitor's pre-hook is moved
    after it before dynamo traces (rows right). A hook that only looks, registered once compiled, costs no
    rows (a review found the first version of this dropping them, and recompiling per block)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        grads, _ = _compiled_run(out_dir, tmp_path, when, compiled=True)
    finally:
        torch._dynamo.reset()
    _, received = _compiled_run(out_dir, tmp_path, when, compiled=False)
    for step in range(STEPS):
        assert ("b.output", step, 0) in grads
        for i in range(2):
            want = received[step][i].double().norm().item()
            assert float(grads[(f"b.input_{i}", step, 0)]["norm"]) == pytest.approx(want, rel=1e-5)


def test_late_pre_hook_passing_a_leaf(tmp_path, out_dir, static_mode):
    """A later pre-hook substituting a parameter (a leaf) for an input: one row per input and step, each
    the gradient of what forward received (a review found the first version's hook on the leaf left
    behind, writing a duplicate row every step)."""
    torch.manual_seed(0)
    model = Net()
    delta = nn.Parameter(torch.randn(3, 4))
    cfg = write_config(
        tmp_path / "c.json", xy_distribution=True, ops=["norm", "max"], format="csv", ndigits=12
    )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=None)
    refs = []
    for step in range(4):
        if step == 1:
            model.b.register_forward_pre_hook(lambda mod, args: (args[0], delta))
        model(torch.randn(3, 4)).square().mean().backward()
        refs.append(dict(model.b.seen))
        model.zero_grad()
        delta.grad = None
        monitor.step()
    monitor.close()
    rows = [r for r in read_family(monitor.run_dir, "actv_grad") if r["name"].startswith("b.input")]
    counted: dict = {}
    for r in rows:
        counted[(r["name"], int(r["step"]))] = counted.get((r["name"], int(r["step"])), 0) + 1
    assert max(counted.values()) == 1, counted
    grads = keyed(rows)
    for step in (0, 2, 3):
        for i, key in enumerate(("x", "y")):
            _check(grads, f"b.input_{i}", step, refs[step][f"{key}_grad"])
    assert not [k for k in counted if k[1] == 1]


def test_late_pre_hook_compiled_after_another_compile(tmp_path, out_dir, static_mode):
    """Something compiled earlier in the process pins the hooks at set_monitor, before the user's hook
    exists: the model's first trace must still order the monitor's pre-hook after it (a review found the
    input-gradient rows 3x too big: the order was fixed only when the hooks were pinned)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))
        grads, _ = _compiled_run(out_dir, tmp_path, "before", compiled=True)
    finally:
        torch._dynamo.reset()
    _, received = _compiled_run(out_dir, tmp_path, "before", compiled=False)
    for step in range(STEPS):
        for i in range(2):
            want = received[step][i].double().norm().item()
            assert float(grads[(f"b.input_{i}", step, 0)]["norm"]) == pytest.approx(want, rel=1e-5)
