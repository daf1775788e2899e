"""actv and actv_grad in torch.compile'd graphs: rows equal the eager run's (backends, CUDA, containment)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from tests.unit.graph_taps_common import (
    OPS,
    Block,
    _same_grad_rows,
    _same_rows,
    _train_rows,
    needs_traced_hooks,
)
from tests.unit.graph_taps_common import _fresh_dynamo as _fresh_dynamo
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

# actv and actv_grad inside torch.compile'd graphs (`runtime/probes/graph_taps.py`): the hooks put
# operator calls in the graph instead of graph breaks, and the rows are the eager run's.
#
# The model has what the taps must name and number as the eager hooks do: blocks run in a `for` loop over a
# ModuleList (a graph break there makes dynamo give up the whole loop), a module with two positional inputs,
# one of them passed twice, and a keyword tensor input, a tuple output with a None (msprobe's NaN row) and an
# integer tensor (no row), a dict output, and two micro-batches per step.
#
# Tolerances: both runs do the same float32 operations on values of order 1. aot_eager runs the traced aten
# ops eagerly (differences: reduction order only, ~1e-7 relative); inductor also fuses the pointwise ops into
# its own loops (vectorised tanh/exp within a few ulp), and the differences pass through at most eight ops to
# a row: rel 1e-4 bounds both with a wide margin and still catches a row read from the wrong buffer (those
# differ by tens of percent here).


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
