"""Graph taps on outputs: in-place writes, reused and rebuilt outputs, micro-steps, gradients kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from tests.unit.graph_taps_common import OPS, _same_grad_rows, _same_rows, _train_rows, needs_traced_hooks
from tests.unit.graph_taps_common import _fresh_dynamo as _fresh_dynamo
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_in_place_module_after_a_tapped_output(tmp_path, out_dir, backend):
    """ReLU(inplace=True) on a tapped module output compiles (dynamo refused a write into a view made
    inside an autograd function). actv rows and actv_grad rows are those of the same model run eagerly
    (the in-place module's input row holds the values after its write, in both modes), but for the
    in-place module's input gradient, which compiled code does not write (said once): the write unhooks
    the view its hook sat on (eager mode finds the write's node instead, test_inplace_modules.py)."""

    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.LayerNorm(8))

    rows = {run: _train_rows(tmp_path, "i", make, run, fullgraph=True) for run in (None, backend)}
    assert all(found[2] == 0 for found in rows.values())
    # LayerNorm's input gradient is a difference of order-1 terms (~1e-2 here): inductor's reduction
    # order moves it by up to ~8 values x few ulp of 1, ~1e-6 each, so it gets an absolute bound of 1e-5
    (actv, grads), (eager_actv, eager_grads) = rows[backend][:2], rows[None][:2]
    _same_rows(actv, eager_actv)
    assert {key for key in eager_grads if key[0] == "1.input"} == {("1.input", 0, 0), ("1.input", 1, 0)}
    want_grads = {key: row for key, row in eager_grads.items() if key[0] != "1.input"}
    _same_grad_rows(grads, want_grads, abs_tol=1e-5)


class WritesThroughAView(nn.Module):
    """A Linear's output written in place through a transposed view by ReLU(inplace=True), whose result is
    dropped: the next Linear reads the written base (found by a review: with an alias from an autograd
    function in the input's place, autograd never saw the write and `a`'s gradients were off by 1.9)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.t, self.r, self.c = nn.Linear(8, 8), Transpose(), nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.r(self.t(h))
        return self.c(h)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class CalledTwice(nn.Module):
    """One module called twice in one forward: backward runs its second call first."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(self.shared(x))))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class FedBack(nn.Module):
    """A block whose output goes straight back into it, `block(block(h))`: both calls' pre-hooks tap no
    tensor, identical operator calls that the compiler's common-subexpression pass merged (the second
    call's input rows took the first call's micro-step: a duplicate row)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block = nn.Linear(8, 8), Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(self.inp(x)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_monitor_leaves_the_gradients_as_they_are(tmp_path, out_dir, backend):
    """Compiled with actv and actv_grad collected, training is what it is without the monitor: every
    parameter's gradient and the input's equal the unmonitored compiled run's (a module writing its
    input's base in place; the monitor changed `a`'s gradient by up to 1.93)."""
    import torch._dynamo

    def grads(make, monitored: bool) -> dict:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        monitor = None
        if monitored:
            monitor = TrainerMon(write_config(tmp_path / "g.json", xy_distribution=True, ops=list(OPS)))
            monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.compile(model, backend=backend, fullgraph=True)(x).square().sum().backward()
        if monitor is not None:
            monitor.close()
            assert monitor.loop.faults.total == 0
        return {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}

    plain, monitored = grads(WritesThroughAView, False), grads(WritesThroughAView, True)
    assert plain.keys() == monitored.keys()
    for name in plain:
        assert torch.equal(plain[name], monitored[name]), (name, (plain[name] - monitored[name]).abs().max())


@needs_traced_hooks
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("make", [CalledTwice, FedBack])
def test_each_call_keeps_its_micro_step(tmp_path, out_dir, backend, make):
    """Each call's gradient rows carry that call's micro-step: a module called twice in one forward (rows
    were swapped, backward running the calls last first; with its output fed straight back in, the
    input rows of both calls had the first call's), and a micro-batch whose forward is dropped (later
    rows shifted by one). The eager run's rows are the reference."""

    def run(make, backend_or_eager):
        import torch._dynamo

        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(write_config(tmp_path / "m.json", xy_distribution=True, ops=list(OPS)))
        monitor.set_monitor(model, optimizer=opt)
        fn = model if backend_or_eager is None else torch.compile(model, backend=backend_or_eager)
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):
            fn(torch.randn(4, 8, generator=gen))  # micro-step 0: its loss dropped, never goes backward
            for _micro in range(2):
                fn(torch.randn(4, 8, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
        assert monitor.loop.faults.total == 0
        return keyed(read_family(monitor.run_dir, "actv_grad"))

    eager, compiled = run(make, None), run(make, backend)
    # two calls per forward: micro-steps 2-3 and 4-5 have gradients, 0-1 (the dropped forward) none
    twice = "shared.output" if make is CalledTwice else "block.input"  # FedBack: both inputs graded
    assert {micro for name, _, micro in eager if name == twice} == {2, 3, 4, 5}, sorted(eager)
    _same_rows(compiled, eager)


def test_an_output_the_hook_cannot_rebuild(tmp_path, out_dir):
    """A namedtuple output (as a ModelOutput would be): its gradient rows are written from inside the
    graph (fullgraph, no break), equal to eager mode's. (Before the output hooks, an output the tap's
    aliases could not be rebuilt into broke the graph. On a torch older than 2.12: no break, no gradient
    rows from the graph.)"""
    from collections import namedtuple

    import torch._dynamo

    Out = namedtuple("Out", "h aux")

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Out:
            h = self.lin(x)
            return Out(torch.tanh(h), h.sum(-1))

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair, self.head = Pair(), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.pair(x)
            return self.head(out.h) + out.aux[:, None]

    rows = {
        backend: _train_rows(tmp_path, "n", Top, backend, fullgraph=True) for backend in (None, "aot_eager")
    }
    assert rows[None][2] == 0 and rows["aot_eager"][2] == 0 and rows["aot_eager"][3] == 0
    assert ("pair.output_0", 0, 0) in rows[None][1]
    _same_rows(rows["aot_eager"][0], rows[None][0])
    _same_grad_rows(rows["aot_eager"][1], rows[None][1])


class Attention(nn.Module):
    """Returns its scores and a value it also uses itself (as HF attention returns its weights):
    `weights` feeds `mixed` inside and is not used outside; `h` is used both inside and outside."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple:
        h = x * 1.5 + 0.1  # no submodule's output: only this module's tap can see its gradient
        weights = torch.softmax(self.q(h), dim=-1)
        mixed = torch.tanh(h) * weights
        return mixed, weights, h


class UsesItsOwnOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.attn, self.b = nn.Linear(8, 8), Attention(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed, _, h = self.attn(self.a(x))
        return self.b(mixed) * h


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_output_the_module_also_uses_itself(tmp_path, out_dir, backend):
    """The gradient row of an output is the whole gradient of that tensor, as in eager mode and msprobe:
    the part that flows back through the module's own use of it too (`h`), and for an output used only
    inside (`weights`), only that part. A tap placed after the forward, on the returned tensor, saw the
    outside part alone (h: norm 5.2 for 6.3) and a zero gradient for `weights`."""
    eager = _train_rows(tmp_path, "e", UsesItsOwnOutputs, None)
    compiled = _train_rows(tmp_path, "c", UsesItsOwnOutputs, backend, fullgraph=True)
    assert eager[2] == 0 and compiled[2] == 0 and compiled[3] == 0
    assert {("attn.output_1", 1, 0), ("attn.output_2", 1, 0)} <= set(eager[1])
    _same_rows(compiled[0], eager[0])
    _same_grad_rows(compiled[1], eager[1])


class SkipBias(nn.Module):
    """Returns its bias for the caller to add (Megatron's `skip_bias_add`): a parameter as an output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, 8))

    def forward(self, x: torch.Tensor) -> tuple:
        return self.lin(x), self.bias


class AddsTheBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.skip = nn.Linear(8, 8), SkipBias()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.skip(self.a(x))
        return torch.tanh(y + bias)


def test_a_parameter_returned_as_an_output(tmp_path, out_dir):
    """The gradient row of a parameter returned as an output comes from a view of it made for the call,
    as in eager mode: a hook on the parameter itself would stay and fire again every later step (rows
    1, 2, 3, ... per step, found after the output hooks came in)."""
    eager = _train_rows(tmp_path, "e", AddsTheBias, None, steps=3)
    compiled = _train_rows(tmp_path, "c", AddsTheBias, "aot_eager", steps=3, fullgraph=True)
    assert eager[2] == 0 and compiled[2] == 0 and compiled[3] == 0
    assert {("skip.output_1", step, 0) for step in range(3)} <= set(eager[1])
    _same_rows(compiled[0], eager[0])
    _same_grad_rows(compiled[1], eager[1])
    # every row once (the rows above are keyed: a repeated row would not show there)
    torch.manual_seed(0)
    model = AddsTheBias()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "count.json", xy_distribution=True, ops=list(OPS)))
    monitor.set_monitor(model, optimizer=opt)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        run(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    rows = read_family(monitor.run_dir, "actv_grad")
    steps = [0, 1, 2] if HOOKS_IN_GRAPH else []
    assert sorted(int(r["step"]) for r in rows if r["name"] == "skip.output_1") == steps
    assert not model.skip.bias._backward_hooks
