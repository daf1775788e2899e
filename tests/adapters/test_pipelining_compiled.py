"""torch.distributed.pipelining with each block compiled on its own (torchtitan's per-block torch.compile,
aot_eager backend: no C++ compile) on 2 gloo ranks, PP2 with Schedule1F1B, 4 micro-batches, 2 steps;
then the same with each block also under activation checkpointing (torchtitan's order: checkpoint_wrapper,
then compile), whose recompute in backward takes the micro-steps the forward kept.

The stage's shape inference at the first step runs the compiled blocks once, outside every micro-batch:
the monitor's taps inside the compiled graphs must write no row and take no micro-step there, as the
eager hooks do. (They did: an extra micro-step 0 row, every real micro-batch shifted by one, actv_grad of
micro 0 missing; on stage 1 that row came from pipelining's uninitialised receive buffers.)

Every actv / actv_grad row of the block outputs and of the modules inside them is checked against a
float64 recompute of the whole model in the test, per (name, step, micro-step), each key written once.
Tolerance as in test_pipelining (1e-4 relative to the tensor's norm).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.adapters.test_pipelining import Model, _close, _stats, batch, loss_fn, stage_part
from tests.distributed import run_ranks
from tests.helpers import read_family, write_config

MICRO, STEPS = 4, 2


def reference() -> dict:
    """float64 whole model, SGD on the mean over micro-batches: per (family, name, step, micro) stats."""
    torch.manual_seed(0)
    model = Model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    modules = {id(m): n for n, m in model.named_modules() if n}
    ref: dict = {}
    for step in range(STEPS):
        x, y = batch(step, 0)
        for micro, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            outs: dict = {}

            def keep(m: nn.Module, args: tuple, out: torch.Tensor, outs: dict = outs) -> None:
                outs[modules[id(m)]] = out

            handles = [m.register_forward_hook(keep) for m in model.modules() if id(m) in modules]
            loss = loss_fn(model(xm.double()), ym.double()) / MICRO  # pipelining scales by 1 / micro-batches
            for h in handles:
                h.remove()
            grads = torch.autograd.grad(loss, list(outs.values()), retain_graph=True)
            for (name, out), g in zip(outs.items(), grads):
                ref["actv", f"{name}.output", step, micro] = _stats(out)
                ref["actv_grad", f"{name}.output", step, micro] = _stats(g * MICRO)  # the loss's own scale
            loss.backward()
        opt.step()
        opt.zero_grad()
    return ref


def _worker(rank: int, world: int, config: str, out_dir: str) -> dict:
    return {ac: _run(rank, config, os.path.join(out_dir, f"ac{int(ac)}"), ac) for ac in (False, True)}


def _run(rank: int, config: str, out_dir: str, ac: bool) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    part = stage_part(Model(), [0, 1] if rank == 0 else [2, 3], last=rank == 1)
    for key, block in list(part.layers.items()):  # torchtitan's per-block compile
        block = checkpoint_wrapper(block) if ac else block
        part.layers.register_module(key, torch.compile(block, backend="aot_eager"))
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(config)
    monitor.set_monitor(part, grad_acc_steps=MICRO, optimizer=opt)
    for step in range(STEPS):
        x, y = batch(step, 0)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
    faults = monitor.faults.total
    monitor.close()
    return {"run_dir": monitor.run_dir, "faults": faults}


def test_compiled_blocks_write_no_row_for_the_shape_inference(tmp_path):
    """Also under activation checkpointing (`ac`: the results of both runs)."""
    config = write_config(
        tmp_path / "c.json", targets={}, xy_distribution=True, ops=["norm", "min", "max", "mean"], ndigits=12
    )
    ref = reference()
    results = run_ranks(_worker, world_size=2, timeout=600, config=config, out_dir=str(tmp_path / "out"))
    for ac in (False, True):
        _check([r[ac] for r in results], ref, ac)


def _check(results: list[dict], ref: dict, ac: bool) -> None:
    assert [r["faults"] for r in results] == [0, 0], ac
    for family in ("actv", "actv_grad"):
        seen: dict = {}
        for r in results:
            for row in read_family(r["run_dir"], family):
                if row["name"].endswith(".input"):  # inputs: the previous module's outputs
                    continue
                key = (family, row["name"], int(row["step"]), int(row["micro_step"]))
                assert key in ref, (ac, key)  # micro-steps 0..3 only: the shape inference is none of them
                for stat in ("norm", "min", "max", "mean"):
                    assert _close(row[stat], ref[key], stat), (ac, key, stat, row[stat], ref[key][stat])
                seen[key] = seen.get(key, 0) + 1
        assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1][:4]
        wanted = {k for k in ref if k[0] == family}
        # every module (inside the compiled blocks too), step and micro-batch, on the stage that holds it
        assert set(seen) == wanted, (ac, family, sorted(wanted - set(seen))[:4])
        inner = {k for k in seen if k[1] == "layers.2.lin1.output"}  # inside a compiled block of stage 1
        assert {k[3] for k in inner} == set(range(MICRO)), inner
