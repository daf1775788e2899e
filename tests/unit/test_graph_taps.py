"""actv and actv_grad inside torch.compile'd graphs (`runtime/probes/graph_taps.py`): the hooks put
operator calls in the graph instead of graph breaks, and the rows are the eager run's.

The model has what the taps must name and number as the eager hooks do: blocks run in a `for` loop over a
ModuleList (a graph break there makes dynamo give up the whole loop), a module with two positional inputs,
one of them passed twice, and a keyword tensor input, a tuple output with a None (msprobe's NaN row) and an
integer tensor (no row), a dict output, and two micro-batches per step.

Tolerances: both runs do the same float32 operations on values of order 1. aot_eager runs the traced aten
ops eagerly (differences: reduction order only, ~1e-7 relative); inductor also fuses the pointwise ops into
its own loops (vectorised tanh/exp within a few ulp), and the differences pass through at most eight ops to
a row: rel 1e-4 bounds both with a wide margin and still catches a row read from the wrong buffer (those
differ by tens of percent here).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

OPS = ("norm", "min", "max")
# On a torch whose dynamo cannot trace tensor hooks (older than 2.12: torch 2.11 on the GPU host in
# session 30), compiled modules write actv rows and no actv_grad rows, by design and said once (README,
# test_a_torch_without_traced_tensor_hooks_writes_no_gradient_rows_in_graphs). Tests about gradient rows
# from inside graphs and nothing else are skipped there; the others check their actv rows all the same.
needs_traced_hooks = pytest.mark.skipif(
    not HOOKS_IN_GRAPH, reason="this torch (older than 2.12) writes no actv_grad rows from compiled graphs"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


class Mix(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, *, gate: torch.Tensor) -> tuple:
        return a * torch.sigmoid(b), None, (gate > 0).long(), a + gate


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict:
        return {"p": self.p(x), "q": torch.tanh(x)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.mix, self.heads = nn.Linear(8, 8), nn.Linear(8, 8), Mix(), Heads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))  # b's input is no module's output: a buffer of its own
        mixed, _, _, skip = self.mix(h, h, gate=x)
        heads = self.heads(mixed)
        return heads["p"] * heads["q"] + skip


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _run(
    tmp_path,
    tag: str,
    backend: str | None,
    steps: int = 3,
    micro: int = 2,
    fullgraph: bool = True,
    device: str = "cpu",
    mode: str | None = None,
    at_hook: bool = True,
):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMon(write_config(tmp_path / f"{tag}.json", xy_distribution=True, ops=list(OPS)))
    monitor.set_monitor(model, optimizer=opt)
    monitor.loop.collector.at_hook = at_hook  # False: no row read at the hook by the native kernel
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph, mode=mode)
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(steps):
        for _ in range(micro):
            if mode == "reduce-overhead":  # a new step for CUDA graphs: the last outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            out = run(torch.randn(4, 8, generator=gen).to(device))
            outputs.append(out.detach().double().cpu())
            out.square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    actv = keyed(read_family(monitor.run_dir, "actv"))
    grads = keyed(read_family(monitor.run_dir, "actv_grad"))
    return actv, grads, outputs, monitor.loop.faults.total, dict(counters["graph_break"])


def _same_rows(got: dict, want: dict, abs_tol: float = 1e-6) -> None:
    assert set(got) == set(want) and want, sorted(set(got) ^ set(want))[:8]
    for key, row in want.items():
        for op in OPS:
            expected, actual = float(row[op]), float(got[key][op])
            if math.isnan(expected):
                assert math.isnan(actual), (key, op, actual)
            else:
                assert actual == pytest.approx(expected, rel=1e-4, abs=abs_tol), (key, op)


def _same_grad_rows(got: dict, want: dict, outside=lambda key: False, **tolerances) -> None:
    """actv_grad rows of a compiled run against the eager run's (`want`, never empty). Where dynamo cannot
    trace tensor hooks, only the rows of modules whose hooks ran outside the graphs (`outside(key)`) are
    written, and no other."""
    assert want
    if not HOOKS_IN_GRAPH:
        want = {key: row for key, row in want.items() if outside(key)}
        if not want:
            assert got == {}, sorted(got)[:8]
            return
    _same_rows(got, want, **tolerances)


def _train_rows(
    tmp_path,
    tag: str,
    make_model,
    backend: str | None,
    *,
    steps: int = 2,
    fullgraph: bool = False,
    input_grad: bool = False,
    **config,
) -> tuple[dict, dict, int, int]:
    """`make_model()` trained `steps` steps on (4, 8) inputs, eagerly (`backend` None) or compiled, with
    actv and actv_grad monitored: (actv rows, actv_grad rows, faults, graph breaks)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = write_config(tmp_path / f"{tag}{backend}.json", xy_distribution=True, ops=list(OPS), **config)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        run(torch.randn(4, 8, generator=gen, requires_grad=input_grad)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return (
        keyed(read_family(monitor.run_dir, "actv")),
        keyed(read_family(monitor.run_dir, "actv_grad")),
        monitor.loop.faults.total,
        sum(counters["graph_break"].values()),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_rows_equal_eager_with_no_graph_break(tmp_path, out_dir, backend):
    """fullgraph=True: any graph break would be an error. The rows (names, micro-steps, values) are the
    eager run's; the model's output row is checked against the output itself."""
    want_actv, want_grad, _, eager_faults, _ = _run(tmp_path, "eager", None)
    actv, grads, outputs, faults, breaks = _run(tmp_path, backend, backend)
    assert not breaks and faults == 0 and eager_faults == 0
    _same_rows(actv, want_actv)
    _same_grad_rows(grads, want_grad)
    # the NaN row of the None output, and none for the integer tensor, as in eager mode
    assert math.isnan(float(actv[("blocks.0.mix.output_1", 0, 0)]["norm"]))
    assert ("blocks.0.mix.output_2", 0, 0) not in actv
    # independent of the eager run: the last block's output is the model's output, its gradient 2 * out
    for step in range(3):
        for micro in range(2):
            out = outputs[2 * step + micro]
            assert float(actv[("blocks.1.output", step, micro)]["norm"]) == pytest.approx(
                float(out.norm()), rel=1e-5
            )
            if HOOKS_IN_GRAPH:
                assert float(grads[("blocks.1.output", step, micro)]["norm"]) == pytest.approx(
                    2 * float(out.norm()), rel=1e-5
                )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_graph_tensors_wait_for_the_batch_as_copies(tmp_path, out_dir, backend, monkeypatch):
    """Where no kernel reads a tap's tensors at once (a GPU; here the CPU with its kernel's read at the hook
    turned off), they are copied into the hook batch, one engine call for many taps instead of one per
    tap: the copies keep the values the compiler then writes over (inductor reuses b's input buffer for
    a later result), so the rows are the eager run's."""
    from trainermon.collect import hook_rows

    calls = {"at_once": 0, "batched": 0}
    real_now, real_held = hook_rows.compute_now, hook_rows.reduce_held

    def now(engine, tensors):
        calls["at_once"] += len(tensors)
        return real_now(engine, tensors)

    def held(engine, batch, *args):
        calls["batched"] += len(batch.tensors)
        return real_held(engine, batch, *args)

    monkeypatch.setattr(hook_rows, "compute_now", now)
    monkeypatch.setattr(hook_rows, "reduce_held", held)
    want_actv, want_grad, *_ = _run(tmp_path, "eager", None)
    calls.update(at_once=0, batched=0)
    actv, grads, _, faults, breaks = _run(tmp_path, backend, backend, at_hook=False)
    assert not breaks and faults == 0
    _same_rows(actv, want_actv)
    _same_grad_rows(grads, want_grad)
    # every tensor of the graphs' taps went through the batch, none was computed at once (a tensor
    # passed twice is copied once, a None output's row has no tensor: at most one per row)
    assert calls["at_once"] == 0 and 0 < calls["batched"] <= len(actv) + len(grads), calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA device on this machine")
def test_compiled_rows_equal_eager_on_cuda(tmp_path, out_dir):
    """The inductor case on a GPU (benchmarks/gpu.sh runs it): the operators read CUDA tensors on the
    stream of the compiled graph, before it reuses their buffers."""
    want_actv, want_grad, *_ = _run(tmp_path, "eager", None, device="cuda")
    actv, grads, _, faults, breaks = _run(tmp_path, "inductor", "inductor", device="cuda")
    assert not breaks and faults == 0
    _same_rows(actv, want_actv)
    _same_grad_rows(grads, want_grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA device on this machine")
@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag"
)
def test_cuda_graphs_record_every_step(tmp_path, out_dir):
    """mode="reduce-overhead" replays CUDA graphs from the third call on; a graph replays kernels, not the
    taps' Python. The taps are tagged cudagraph-unsafe, so inductor runs them between the graphs' parts:
    every step's rows are there and are the eager run's. (Untagged, the taps were captured, and CUDA-graph
    trees failed the step at capture: "tensor(s) in the cudagraph pool not tracked as outputs".)"""
    want_actv, want_grad, *_ = _run(tmp_path, "eager", None, steps=5, micro=1, device="cuda")
    actv, grads, _, faults, breaks = _run(
        tmp_path, "graphs", "inductor", steps=5, micro=1, device="cuda", mode="reduce-overhead"
    )
    assert not breaks and faults == 0
    assert {key[1] for key in actv} == set(range(5))
    _same_rows(actv, want_actv)
    _same_grad_rows(grads, want_grad)


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag"
)
def test_taps_are_not_captured_into_cuda_graphs(tmp_path, out_dir):
    """The CPU half of the test above: the operators carry the tag, and inductor's own rule for what a CUDA
    graph may hold (`get_first_incompatible_cudagraph_node`, a private helper: skipped where it is gone)
    finds the tap in the compiled forward graph and the gradient tap in the backward graph."""
    from trainermon.runtime.probes import tap_ops

    assert tap_ops.available()
    for op in (torch.ops.trainermon.tap.default, torch.ops.trainermon.tap_grad.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op
    try:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.utils import get_first_incompatible_cudagraph_node
    except ImportError as exc:
        pytest.skip(f"inductor's CUDA-graph rule is not importable here: {exc}")
    found = []

    def keep(gm, example_inputs):  # what inductor would be given, checked by its CUDA-graph rule
        node = get_first_incompatible_cudagraph_node(gm)
        found.append(None if node is None else node.target)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", xy_distribution=True, ops=list(OPS)))
    monitor.set_monitor(model, optimizer=opt)
    run = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    run(torch.randn(4, 8)).sum().backward()
    opt.step()
    monitor.close()
    # no backward tap where dynamo cannot trace tensor hooks (older than 2.12)
    grad_tap = torch.ops.trainermon.tap_grad.default if HOOKS_IN_GRAPH else None
    assert found == [torch.ops.trainermon.tap.default, grad_tap], found


def test_a_failing_tap_is_contained(tmp_path, out_dir, monkeypatch):
    """A tap whose rows fail (here: the collector raises) is logged and counted; the compiled step runs on
    and computes what it computes without the monitor."""
    from trainermon.runtime.loop import StepLoop

    def broken(*args, **kwargs):
        raise RuntimeError("collector down")

    torch.manual_seed(0)
    reference = Model()
    torch.manual_seed(0)
    model = Model()
    monitor = TrainerMon(write_config(tmp_path / "c.json", xy_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setattr(StepLoop, "record_local", broken)
    x = torch.randn(4, 8)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    out.square().sum().backward()
    monitor.close()
    assert torch.allclose(out, reference(x), rtol=1e-6, atol=1e-7)
    assert monitor.loop.faults.total > 0
    assert all(p.grad is not None for p in model.parameters())


def test_without_the_tap_operators_hooks_break_the_graph(tmp_path, out_dir, monkeypatch):
    """Where the operators cannot be registered, the hooks run outside the graph as before: graph breaks,
    the same rows."""
    from trainermon.runtime.probes import graph_taps

    want_actv, want_grad, *_ = _run(tmp_path, "eager", None, steps=2)
    monkeypatch.setattr(graph_taps, "available", lambda: False)
    actv, grads, _, faults, breaks = _run(tmp_path, "breaks", "aot_eager", steps=2, fullgraph=False)
    assert breaks and faults == 0
    _same_rows(actv, want_actv)
    _same_rows(grads, want_grad)


def test_checkpointed_blocks_inside_the_graph(tmp_path, out_dir):
    """Non-reentrant activation checkpointing inside the compiled region (dynamo traces it as one
    operator): rows equal the eager checkpointed run's, with no second row for the recompute."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    eager = _train_rows(tmp_path, "k", Checkpointed, None, input_grad=True)
    compiled = _train_rows(tmp_path, "k", Checkpointed, "aot_eager", input_grad=True)
    assert compiled[2:] == (0, 0) and eager[2] == 0  # no fault, no graph break
    _same_rows(compiled[0], eager[0])
    _same_grad_rows(compiled[1], eager[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_module_called_twice_in_one_graph(tmp_path, out_dir, backend):
    """A module applied twice in one forward (shared weights), actv only: with no autograd function
    between them, only the operators' order in the compiled graph keeps the calls' micro-steps in order."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(torch.tanh(self.shared(x)))

    eager = _train_rows(tmp_path, "t", Twice, None, forward_only=True)
    compiled = _train_rows(tmp_path, "t", Twice, backend, fullgraph=True, forward_only=True)
    assert compiled[2] == 0 and not compiled[1]
    assert {(name, micro) for name, step, micro in compiled[0] if step == 0} == {
        (f"shared.{io}", micro) for io in ("input", "output") for micro in (0, 1)
    }
    _same_rows(compiled[0], eager[0])


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


def _rows_on_ranks(rank: int, world_size: int, out: str) -> dict:
    """On each rank, eager then compiled (aot_eager): DDP with its graph splitter, FSDP2 with each block
    compiled on its own (as torchtitan does), tensor parallelism, and tensor with sequence parallelism
    with each block compiled on its own. Returns the rows, faults and graph
    counts."""
    import os

    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, f"rank{rank}")

    def ddp(compiled: bool) -> tuple:
        # 1 MiB per Linear, buckets of 1 MiB: DDP's graph splitter cuts the compiled graph into pieces
        model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(512, 512), nn.GELU())])
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        return wrapped, (torch.compile(wrapped, backend="aot_eager") if compiled else wrapped), 512

    def fsdp(compiled: bool) -> tuple:
        model = nn.Sequential(Block(), Block())
        for block in model:
            if compiled:
                block.compile(backend="aot_eager")
            fully_shard(block)
        fully_shard(model)
        return model, model, 8

    def tp(compiled: bool) -> tuple:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Tanh(), nn.Linear(16, 8))
        # the first Linear's output stays a DTensor (sharded on its last dim) into ReLU, which writes it in
        # place, Tanh and the last Linear
        parallel = {"0": ColwiseParallel(use_local_output=False), "3": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (world_size,)), parallel)
        return model, (torch.compile(model, backend="aot_eager") if compiled else model), 8

    def tp_sp(compiled: bool) -> tuple:
        # torchtitan's layout: sequence parallelism on the norm, the FFN sharded, DTensors between the
        # blocks (each block's input is a DTensor sharded on the sequence), each block compiled on its own
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        model = nn.Sequential(SequenceBlock(), SequenceBlock())
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model:
            parallel = {
                "norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
            parallelize_module(block, mesh, parallel)
            if compiled:
                block.compile(backend="aot_eager")
        return model, model, 8

    found = {}
    for setup in (ddp, fsdp, tp, tp_sp):
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            model, run, width = setup(compiled)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            cfg = Path(out) / f"{setup.__name__}{rank}{compiled}.json"
            monitor = TrainerMon(write_config(cfg, xy_distribution=True, ops=list(OPS)))
            monitor.set_monitor(model, optimizer=opt)
            gen = torch.Generator().manual_seed(1 + (0 if setup in (tp, tp_sp) else rank))  # TP: one batch
            refs: dict = {}
            for step in range(2):
                x = torch.randn(4, width, generator=gen)
                if setup is tp:
                    refs.update(_tp_pieces(model, x, step, rank, world_size))
                if setup is tp_sp:  # (batch, sequence, width): this rank's piece of the sequence
                    from torch.distributed.tensor import DTensor, Shard

                    x = torch.randn(2, 4, width, generator=gen).chunk(world_size, dim=1)[rank]
                    x = DTensor.from_local(x, model[0].norm.weight.device_mesh, [Shard(1)])
                    run(x).to_local().square().mean().backward()
                else:
                    run(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            monitor.close()
            found[setup.__name__, compiled] = (
                keyed(read_family(monitor.run_dir, "actv")),
                keyed(read_family(monitor.run_dir, "actv_grad")),
                monitor.loop.faults.total,
                counters["stats"]["unique_graphs"],
                sum(counters["graph_break"].values()),
                refs,
            )
    # a DTensor that the operators' rule cannot read: counted, the step runs (never a failed compile)
    from trainermon.runtime.probes import tap_ops

    def unreadable(t):
        raise RuntimeError("unreadable DTensor")

    torch._dynamo.reset()
    model, run, width = tp(True)
    monitor = TrainerMon(write_config(Path(out) / f"faulty{rank}.json", xy_distribution=True, ops=list(OPS)))
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    real, tap_ops.local_view = tap_ops.local_view, unreadable
    try:
        loss = run(torch.ones(4, width)).square().mean()
        loss.backward()
    finally:
        tap_ops.local_view = real
    monitor.close()
    found["faulty"] = (monitor.loop.faults.total, math.isfinite(float(loss)))

    # Where the rule cannot be registered (a torch without register_torch_dispatch), DTensor hooks break
    # the graph as before; the rows stay eager mode's. (No in-place ReLU here: torch 2.13 cannot compile
    # it around a break, the failure the rule avoids.)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def refuse(*args, **kwargs):
        raise AttributeError("register_torch_dispatch")

    rows = []
    saved = tap_ops._state.pop("dtensor", None), torch.library.register_torch_dispatch
    torch.library.register_torch_dispatch = refuse
    try:
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
            parallel = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()}
            parallelize_module(model, init_device_mesh("cpu", (world_size,)), parallel)
            cfg = write_config(
                Path(out) / f"norule{rank}{compiled}.json", xy_distribution=True, ops=list(OPS)
            )
            monitor = TrainerMon(cfg)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            monitor.set_monitor(model, optimizer=opt)
            run = torch.compile(model, backend="aot_eager") if compiled else model
            run(torch.ones(4, 8)).square().mean().backward()
            opt.step()  # the step's rows are written at its optimizer step
            monitor.close()
            breaks = sum(counters["graph_break"].values())
            rows.append((keyed(read_family(monitor.run_dir, "actv")), monitor.loop.faults.total, breaks))
    finally:
        torch.library.register_torch_dispatch = saved[1]
        tap_ops._state["dtensor"] = saved[0]
    found["no rule"] = (rows, tap_ops._state["dtensor"])
    return found


class SequenceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.w1, self.w2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(self.norm(x))))


def _tp_pieces(model: nn.Module, x: torch.Tensor, step: int, rank: int, world_size: int) -> dict:
    """The reference for the tensor-parallel model: its forward and backward in float64 on full weights
    (gathered from the DTensors), and this rank's column piece of the activations and gradients that stay
    sharded. ReLU writes its input in place: its input row holds the values after the write (its output),
    its input-gradient row the gradient before the ReLU."""
    from tests.helpers import ref_stats

    full = {name: p.full_tensor().detach().double() for name, p in model.named_parameters()}
    z = (x.double() @ full["0.weight"].T + full["0.bias"]).requires_grad_()
    h = z.relu()
    h.retain_grad()
    t = h.tanh()
    t.retain_grad()
    (t @ full["3.weight"].T + full["3.bias"]).square().mean().backward()
    cols = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    label = f"Shard(1)[0={rank}/{world_size}]"
    pieces = {
        ("actv", "1.input"): h,
        ("actv", "1.output"): h,
        ("actv", "2.input"): h,
        ("actv", "2.output"): t,
        ("actv_grad", "0.output"): z.grad,
        ("actv_grad", "1.input"): z.grad,
        ("actv_grad", "1.output"): h.grad,
        ("actv_grad", "2.input"): h.grad,
        ("actv_grad", "2.output"): t.grad,
    }
    return {(family, name, step): (ref_stats(v[:, cols]), label) for (family, name), v in pieces.items()}


def test_ddp_and_fsdp2_on_two_ranks(tmp_path):
    """On 2 gloo ranks: DDP under torch.compile, whose graph splitter cuts the graph at bucket
    boundaries (the taps survive the split; an effect token did not); FSDP2 with each block compiled
    on its own (no graph break there); tensor parallelism with DTensor activations, written in place by
    ReLU(inplace=True) (their hooks stay in the graph: with graph breaks there torch 2.13 failed to
    compile the model); torchtitan's sequence-parallel blocks, compiled one by one, DTensors between
    them (session 29 saw such blocks fail to compile). Rows equal the eager run's on every rank, but
    for the in-place ReLU's input gradient, which compiled code does not write; no hook fails. The
    tensor-parallel rows, in both modes, equal this rank's piece of a float64 reference built from the
    full weights (rtol 1e-5: float32 against float64 over at most four ops on values of order 1, ~1e-6
    at most)."""
    from tests.distributed import run_ranks

    for found in run_ranks(_rows_on_ranks, world_size=2, out=str(tmp_path)):
        for setup in ("ddp", "fsdp", "tp", "tp_sp"):
            compiled, eager = found[setup, True], found[setup, False]
            assert compiled[2] == 0 and eager[2] == 0
            # torch 2.11 runs compiled DDP's forward eagerly (its own graph breaks, with or without the
            # monitor: no graph), and the hooks with it
            in_graphs = compiled[3] >= 1
            assert in_graphs or (setup == "ddp" and not HOOKS_IN_GRAPH)
            _same_rows(compiled[0], eager[0])
            # compiled, the in-place ReLU's input gradient is not written (test_an_in_place_module_...)
            want = {k: v for k, v in eager[1].items() if not (setup == "tp" and k[0] == "1.input")}
            if in_graphs:  # a block's own hooks ("0.output") run outside its compiled forward
                blocks = setup in ("fsdp", "tp_sp")  # each block compiled on its own
                outside = (lambda key: key[0].count(".") == 1) if blocks else (lambda key: False)
                _same_grad_rows(compiled[1], want, outside=outside)
            else:
                _same_rows(compiled[1], want)
        assert found["fsdp", True][4] == 0  # the blocks' graphs: no break
        assert found["tp", True][4] == 0  # DTensor activations stay in the graph
        # no break in the blocks compiled one by one; two graphs, as without the monitor: the first block's
        # input takes no gradient, the second's does (dynamo guards on it)
        assert found["tp_sp", True][3:5] == (2, 0), found["tp_sp", True][3:5]
        if HOOKS_IN_GRAPH:  # older torch: only the blocks' own hooks, which run outside their graphs
            assert {name for name, _, _ in found["tp_sp", True][1]} >= {
                "1.input",
                "1.norm.input",
                "1.w2.output",
            }
        assert found["faulty"][0] >= 1 and found["faulty"][1]
        (eager, compiled), _ = found["no rule"]
        assert compiled[2] >= 1 and compiled[1] == 0 and eager[1] == 0  # breaks, no fault
        _same_rows(compiled[0], eager[0])
        refs = found["tp", False][5]
        assert len(refs) == 18
        for compiled in (False, True):
            rows = {"actv": found["tp", compiled][0], "actv_grad": found["tp", compiled][1]}
            for (family, name, step), (ref, label) in refs.items():
                if compiled and family == "actv_grad" and (name == "1.input" or not HOOKS_IN_GRAPH):
                    assert (name, step, 0) not in rows[family]
                    continue
                row = rows[family][(name, step, 0)]
                assert row["shard"] == label, (family, name, row["shard"])
                assert_row_matches(row, ref, OPS)


@needs_traced_hooks
def test_a_forward_left_without_backward_does_not_shift_the_next_step(tmp_path, out_dir):
    """Step 0 runs a second forward whose result is dropped (its backward never runs); step 1's gradient
    rows still carry step 1's own micro-steps, as in eager mode (the queue of step 0 is dropped)."""
    import torch._dynamo

    rows = {}
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        monitor = TrainerMon(write_config(tmp_path / f"d{backend}.json", xy_distribution=True, ops=list(OPS)))
        monitor.set_monitor(model, optimizer=opt)
        run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
        gen = torch.Generator().manual_seed(1)
        run(torch.randn(4, 8, generator=gen)).square().sum().backward()
        run(torch.randn(4, 8, generator=gen))  # micro-step 1 of step 0: never goes backward
        opt.step()
        opt.zero_grad()
        run(torch.randn(4, 8, generator=gen)).square().sum().backward()
        opt.step()
        monitor.close()
        assert monitor.loop.faults.total == 0
        rows[backend] = keyed(read_family(monitor.run_dir, "actv_grad"))
    assert {micro for _, step, micro in rows["aot_eager"] if step == 1} == {0}
    _same_rows(rows["aot_eager"], rows[None])


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


def test_a_torch_without_traced_tensor_hooks_writes_no_gradient_rows_in_graphs(
    tmp_path, out_dir, monkeypatch, caplog
):
    """On a torch whose dynamo cannot trace `register_hook` on a graph's tensors (older than 2.12;
    simulated here by switching the feature off), compiled modules get their actv rows and no actv_grad
    rows, said once; no graph break, and the model's gradients are those of the run without the monitor
    (aliases from an autograd function, used before, changed them, see the in-place test below)."""
    import logging

    from trainermon.runtime.probes import graph_taps

    eager = _run(tmp_path, "eager", None)
    monkeypatch.setattr(graph_taps, "HOOKS_IN_GRAPH", False)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        actv, grads, outputs, faults, breaks = _run(tmp_path, "old", "aot_eager")
    assert faults == 0 and not breaks and grads == {}
    _same_rows(actv, eager[0])
    said = [r.getMessage() for r in caplog.records if "cannot trace tensor hooks" in r.getMessage()]
    assert len(said) == 1, said
    for got, want in zip(outputs, eager[2]):  # same training: the same outputs, step after step
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


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
