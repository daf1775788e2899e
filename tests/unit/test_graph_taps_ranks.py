"""Graph taps on 2 gloo ranks: DDP and FSDP2 under torch.compile, and a tensor-parallel block."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, write_config
from tests.unit.graph_taps_common import OPS, Block, _same_grad_rows, _same_rows
from tests.unit.graph_taps_common import _fresh_dynamo as _fresh_dynamo
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH


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

    def tp_sp_local(compiled: bool) -> tuple:
        # torchtitan's exact layout: the blocks take and return this rank's piece as a plain tensor (the
        # embedding's and w2's use_local_output), which SequenceParallel wraps into a DTensor inside the
        # compiled frame. The first block's input is what the embedding returns, an AsyncCollectiveTensor
        # that requires gradient: a hook on the norm's input then failed the compile (aot_autograd)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        model = nn.Sequential(SequenceBlock(), SequenceBlock())
        # no weight: the first norm's output stems from that input alone (its output hook failed too)
        model[0].norm = nn.LayerNorm(8, elementwise_affine=False)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model:
            parallel = {
                "norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            }
            parallelize_module(block, mesh, parallel)
            if compiled:
                block.compile(backend="aot_eager", fullgraph=True)
        return model, model, 8

    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainermon").addHandler(handler)
    found = {}
    for setup in (ddp, fsdp, tp, tp_sp, tp_sp_local):
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
            said.clear()
            losses = []
            for step in range(2):
                x = torch.randn(4, width, generator=gen)
                if setup is tp:
                    refs.update(_tp_pieces(model, x, step, rank, world_size))
                if setup is tp_sp:  # (batch, sequence, width): this rank's piece of the sequence
                    from torch.distributed.tensor import DTensor, Shard

                    x = torch.randn(2, 4, width, generator=gen).chunk(world_size, dim=1)[rank]
                    x = DTensor.from_local(x, model[0].norm.weight.device_mesh, [Shard(1)])
                    run(x).to_local().square().mean().backward()
                elif setup is tp_sp_local:
                    from torch.distributed._functional_collectives import AsyncCollectiveTensor

                    x = torch.randn(2, 4, width, generator=gen).chunk(world_size, dim=1)[rank].contiguous()
                    loss = run(AsyncCollectiveTensor(x).requires_grad_()).square().mean()
                    loss.backward()
                    losses.append(float(loss))
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
            found[setup.__name__, compiled, "said"] = (losses, list(said))
    logging.getLogger("trainermon").removeHandler(handler)
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
        # torchtitan's layout (plain tensors between the blocks, the first block's input an
        # AsyncCollectiveTensor): it trains with the monitor on, losses as in eager mode (to float32
        # rounding), no break under fullgraph; the first block's DTensor inputs and outputs get no gradient
        # row, said once naming a module, and the first block's own input none either: torch's compiled block
        # gives no gradient to such an input at all (with or without the monitor). Every other row
        # equals eager mode's
        (eager_losses, _), (compiled_losses, messages) = (
            found["tp_sp_local", False, "said"],
            found["tp_sp_local", True, "said"],
        )
        assert compiled_losses == pytest.approx(eager_losses, rel=1e-6) and len(compiled_losses) == 2
        collective = [m for m in messages if "AsyncCollectiveTensor" in m]
        assert len(collective) == 1 and "module 0." in collective[0], messages
        assert found["tp_sp_local", True][4] == 0
        eager_grads, compiled_grads = found["tp_sp_local", False][1], found["tp_sp_local", True][1]
        lost = {key for key in eager_grads if key[0].startswith("0.") and key[0].endswith(".input")}
        lost |= {key for key in eager_grads if key[0] == "0.norm.output"}  # a DTensor (SequenceParallel)
        if HOOKS_IN_GRAPH:
            assert {name for name, _, _ in lost} == {
                "0.input",
                "0.norm.input",
                "0.norm.output",
                "0.w1.input",
                "0.w2.input",
            }
            assert {name for name, _, _ in compiled_grads} >= {"1.norm.input", "1.norm.output", "0.w1.output"}
        want = {key: row for key, row in eager_grads.items() if key not in lost}
        _same_grad_rows(compiled_grads, want, outside=lambda key: key[0].count(".") == 1)
        _same_rows(found["tp_sp_local", True][0], found["tp_sp_local", False][0])
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
