"""Graph taps where blocks are compiled on their own, with graph breaks inside their forward."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from tests.unit.graph_taps_common import OPS, _same_grad_rows, _same_rows, _train_rows, needs_traced_hooks
from tests.unit.graph_taps_common import _fresh_dynamo as _fresh_dynamo
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH


class _Broken(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        torch._dynamo.graph_break()  # dynamo then compiles the module's hooks as frames of their own
        return y


def test_hooks_compiled_as_frames_of_their_own(tmp_path, out_dir):
    """A graph break inside a module's forward makes dynamo compile its hooks as frames of their own, one
    code object shared by every module's hook (torch 2.11 did this to compiled DDP's hooks). Each module
    keeps its own rows: before the fix the third Linear's hook reused the second's compiled frame, and
    its rows went to module 2 as a second micro-step."""

    def make() -> nn.Module:
        return nn.Sequential(_Broken(8, 8), nn.Tanh(), _Broken(8, 8), _Broken(8, 8))

    eager = _train_rows(tmp_path, "f", make, None)
    compiled = _train_rows(tmp_path, "f", make, "aot_eager")
    assert compiled[2] == 0 and compiled[3] >= 3  # no fault; the breaks happened
    for got, want in zip(compiled[:2], eager[:2]):
        _same_rows(got, want)


class _BrokenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def _block_rows(tmp_path, mode: str, caplog) -> tuple[dict, dict, list[str]]:
    """Two `_BrokenBlock`s trained 3 steps eagerly, compiled one by one (`wrapped`: torch.compile(block),
    torchtitan's way) or with `block.compile()` (`method`): actv rows, actv_grad rows, the "never fired"
    warnings."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # nothing compiled before: the monitor resets no cache of its own
    torch.manual_seed(0)
    model = nn.Sequential(_BrokenBlock(), _BrokenBlock())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / f"{mode}.json", xy_distribution=True, ops=list(OPS)))
    monitor.set_monitor(model, optimizer=opt)
    for i in range(2):
        if mode == "wrapped":
            model[i] = torch.compile(model[i], backend="aot_eager")
        elif mode == "method":
            model[i].compile(backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for _ in range(3):
            model(torch.randn(4, 8, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    assert monitor.loop.faults.total == 0
    said = [r.getMessage() for r in caplog.records if "never fired" in r.getMessage()]
    actv, grads = (keyed(read_family(monitor.run_dir, f)) for f in ("actv", "actv_grad"))
    return actv, grads, said


def _hook_frames_as_in_a_fresh_process() -> None:
    """The hooks' frames back to dynamo's default strategy: as in a process where no monitor has
    registered a hook yet."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    from trainermon.runtime.probes import hooked_module

    default = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)
    for hook in (hooked_module.HookedModule.pre, hooked_module.HookedModule.forward):
        set_code_exec_strategy(hook.__code__, default)


@needs_traced_hooks
def test_blocks_compiled_on_their_own_with_a_graph_break(tmp_path, out_dir, caplog):
    """Blocks compiled one by one with a graph break inside their forward: dynamo compiles their hooks as
    frames of their own, where the pre-hook's view of the second block's input left its graph as an alias
    of the graph's input and lost its gradient hook: `1.input`'s actv_grad rows were missing, silently,
    in a fresh process (session 30; later tests in the same process passed, the hooks' frames already
    set to run eagerly). The hooks' frames are now set to run eagerly when the first hook is registered:
    every row equals the eager run's, whichever way the blocks are compiled, and nothing is said."""
    _hook_frames_as_in_a_fresh_process()
    eager_actv, eager_grads, said = _block_rows(tmp_path, "eager", caplog)
    assert not said and {("1.input", step, 0) for step in range(3)} <= set(eager_grads)
    for mode in ("wrapped", "method"):
        actv, grads, said = _block_rows(tmp_path, mode, caplog)
        _same_rows(actv, eager_actv)
        _same_rows(grads, eager_grads)
        assert not said, (mode, said)


@needs_traced_hooks
def test_input_gradients_lost_in_compiled_code_are_said(tmp_path, out_dir, caplog, monkeypatch):
    """Where the hooks' frames cannot be set to run eagerly (a torch without the private setter, simulated
    here by setting them back to dynamo's default), the second block's input gradient hooks never fire:
    that is said once, naming the block, and every other row equals the eager run's."""
    from trainermon.runtime.probes import activations, hooked_module

    eager_actv, eager_grads, _ = _block_rows(tmp_path, "eager", caplog)
    real = hooked_module.never_frames_of_their_own
    monkeypatch.setattr(activations, "never_frames_of_their_own", lambda: None)
    monkeypatch.setattr(hooked_module, "never_frames_of_their_own", lambda: None)
    try:
        _hook_frames_as_in_a_fresh_process()
        actv, grads, said = _block_rows(tmp_path, "wrapped", caplog)
    finally:
        real()  # as every other test of this process has them
    _same_rows(actv, eager_actv)
    _same_rows(grads, {key: row for key, row in eager_grads.items() if key[0] != "1.input"})
    assert not any(key[0] == "1.input" for key in grads)
    assert len(said) == 1 and "module(s) 1 never fired" in said[0], said


class _ShapeOnly(nn.Module):
    """Uses its input for its shape only (a learned positional embedding): its input gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 64).reshape(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w[: x.shape[0]].expand_as(x)


@needs_traced_hooks
def test_an_input_without_gradient_is_not_called_lost(tmp_path, out_dir, caplog):
    """A module whose output does not depend on its input: no input row in either mode, and in a graph
    with no break nothing is said about lost input gradients (it was, before the warning waited for a
    graph break, which the known loss needs)."""
    import logging

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), _ShapeOnly(), nn.Tanh())

    eager = _train_rows(tmp_path, "s", make, None)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        compiled = _train_rows(tmp_path, "s", make, "aot_eager", fullgraph=True)
    assert compiled[2:] == (0, 0) and ("1.output", 0, 0) in eager[1]
    assert not any(key[0] == "1.input" for key in eager[1])
    _same_rows(compiled[0], eager[0])
    _same_rows(compiled[1], eager[1])
    assert not [r for r in caplog.records if "never fired" in r.getMessage()]


class Layer(nn.Module):
    """One of many identical blocks: each runs compiled only if dynamo compiled it (the counter below)."""

    eager_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            Layer.eager_calls += 1  # traced away in a compiled block
        return x + self.fc2(self.act(self.fc1(x)))


def test_blocks_compiled_one_by_one_share_their_graphs(tmp_path, out_dir):
    """torchtitan compiles each block on its own. With the hooks' module keys as graph inputs (not guarded
    constants), twelve identical blocks share their graphs: every block runs compiled (dynamo's
    recompile_limit is 8: one compile per block would leave four eager), the graph count does not grow
    with the blocks, and the rows equal the eager run's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def make() -> nn.Module:
        return nn.Sequential(*[Layer() for _ in range(12)])

    rows = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = write_config(tmp_path / f"blocks{compiled}.json", xy_distribution=True, ops=list(OPS))
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        if compiled:
            for i, block in enumerate(model):
                model[i] = torch.compile(block, backend="aot_eager")
        gen = torch.Generator().manual_seed(1)
        for _step in range(3):
            Layer.eager_calls = 0
            model(torch.randn(4, 8, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
        if compiled:
            assert Layer.eager_calls == 0  # the last step: every block compiled
            assert counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])
        assert monitor.faults.total == 0
        rows[compiled] = (
            keyed(read_family(monitor.run_dir, "actv")),
            keyed(read_family(monitor.run_dir, "actv_grad")),
        )
    _same_rows(rows[True][0], rows[False][0])
    # each block's own hooks run outside its compiled forward
    _same_grad_rows(rows[True][1], rows[False][1], outside=lambda key: key[0].count(".") == 1)
    assert ("11.fc2.output", 2, 0) in rows[True][0]
    assert (("11.fc2.output", 2, 0) in rows[True][1]) == HOOKS_IN_GRAPH


class _ViewOut(nn.Module):
    """Returns a view of its last submodule's output, as GPT-2's `transformer` returns a reshape of its
    final norm's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.a(x))).view(-1, 8)


class _HeadAfterBreak(nn.Module):
    """`body`'s output leaves the graph at a break in the head's forward hook (a user's hook printing a
    `.item()`), and is used after it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _ViewOut(), nn.Linear(8, 8)
        self.head.register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h[:, 0:]) + h


@needs_traced_hooks
def test_an_output_view_whose_gradient_hook_the_compiler_drops_is_said(tmp_path, out_dir, caplog):
    """torch 2.13 rebuilds a graph output that is a view of another tensor outside the graph, without the
    hook on it: `body.output`'s actv_grad rows are missing in compiled code (HF Trainer, GPT-2 with a
    graph break after `transformer`). Said once, naming the module; every other row equals the eager
    run's. Before: missing, silently."""
    import logging

    eager = _train_rows(tmp_path, "v", _HeadAfterBreak, None)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        compiled = _train_rows(tmp_path, "v", _HeadAfterBreak, "aot_eager")
    said = [r.getMessage() for r in caplog.records if "never fired" in r.getMessage()]
    assert compiled[2] == 0 and compiled[3] >= 1  # no fault; the break happened
    assert {("body.output", step, 0) for step in range(2)} <= set(eager[1])
    _same_rows(compiled[0], eager[0])
    if ("body.output", 0, 0) in compiled[1]:  # a torch that keeps the hook: the rows, and nothing said
        _same_rows(compiled[1], eager[1])
        assert not said, said
    else:
        _same_rows(compiled[1], {key: row for key, row in eager[1].items() if key[0] != "body.output"})
        assert len(said) == 1 and "output gradient hooks of module(s) body never fired" in said[0], said
