"""cc_distribution sees the collectives of DDP and FSDP2 themselves (2 gloo ranks, one launch): DDP's
gradient all-reduces (through DDP's own default all-reduce hook, registered by the monitor) against the
averaged gradients of an unwrapped reference fed every rank's known data; FSDP2's all-gathers against the
full parameters, its reduce-scatters and DTensor's functional collectives present; the invariant checks
silent on all of them; Megatron-Core's distributed optimizer (reduce-scatters and all-gathers issued in
`_coalescing_manager` blocks through module-global aliases) likewise; a dynamic switch-off removes every
patch at the next step."""

from __future__ import annotations

import copy
import json
import math
import os
import time

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

OPS = ["norm", "mean", "min", "max"]


def _cfg(out_root: str, tag: str, rank: int) -> str:
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    path = os.path.join(out_root, f"{tag}-{rank}.json")
    with open(path, "w") as fh:
        json.dump({"cc_distribution": {"enable": True}, "ops": OPS, "ndigits": 12}, fh)
    return path


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _ddp(rank: int, world: int, out_root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.001)  # small buckets: several all-reduces per backward
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    monitor = TrainerMon(_cfg(out_root, "ddp", rank))
    monitor.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    want = []
    for step in range(2):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        for r in range(world):  # the averaged gradient, from every rank's known data
            (reference(_x(step, r)).pow(2).mean() / world).backward()
        want.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters())))
        ddp(_x(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    probe = monitor.loop.probes[-1]
    monitor.close()
    return {"rows": read_family(monitor.run_dir, "comm"), "want": want, "violations": len(probe.violations)}


def _ddp_user_hook(rank: int, world: int, out_root: str) -> dict:
    """The user's own fp16 compression hook, registered before and after set_monitor: both orders train
    with exactly the gradients of the same DDP model without the monitor; its fp16 all-reduces are seen."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    out = {}
    for order in ("before", "after"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))
        plain = DDP(copy.deepcopy(model), bucket_cap_mb=0.001)
        plain.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ddp = DDP(model, bucket_cap_mb=0.001)
        if order == "before":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        monitor = TrainerMon(_cfg(out_root, f"ddp-hook-{order}", rank))
        opts = (torch.optim.SGD(plain.parameters(), lr=0.05), torch.optim.SGD(ddp.parameters(), lr=0.05))
        monitor.set_monitor(ddp, grad_acc_steps=1, optimizer=opts[1])
        if order == "after":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # must not raise
        exact = True
        for step in range(2):
            for m in (plain, ddp):
                m.zero_grad()
                m(_x(step, rank)).pow(2).mean().backward()
            exact &= all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters()))
            for opt in opts:
                opt.step()
        monitor.close()
        rows = read_family(monitor.run_dir, "comm")
        out[order] = {
            "exact": exact,
            "dtypes": sorted({r["dtype"] for r in rows if r["name"].startswith("all_reduce/")}),
        }
    return out


def _fsdp(rank: int, world: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMon(_cfg(out_root, "fsdp", rank))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    full_sumsq = []
    for step in range(2):
        # DTensor.full_tensor(): a functional all-gather, seen too (a call site of this file)
        full_sumsq.append(
            sum(float(p.detach().full_tensor().double().pow(2).sum()) for p in model.parameters())
        )
        model(_x(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    probe = monitor.loop.probes[-1]
    monitor.close()
    return {
        "rows": read_family(monitor.run_dir, "comm"),
        "full_sumsq": full_sumsq,
        "violations": len(probe.violations),
        "unchecked": probe.unchecked,
    }


def _dynamic(rank: int, world: int, out_root: str) -> dict:
    """Dynamic mode: collection switched off by an edit of the file; the patches go at the next step."""
    import torch.distributed as dist

    from trainermon import TrainerMon
    from trainermon.runtime.control import update_config_file

    os.environ["DYNAMIC_MONITOR"] = "true"
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "dynamic")
    path = os.path.join(out_root, "dynamic.json")
    if rank == 0:
        with open(path, "w") as fh:
            json.dump({"cc_distribution": {"enable": True}, "dynamic_on": True, "ops": OPS}, fh)
    dist.barrier()
    original = dist.all_reduce
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    patched = []
    for step in range(5):
        patched.append(dist.all_reduce is not original)
        if step == 2 and rank == 0:
            update_config_file(path, dynamic_on=False)
            watcher = monitor.loop.control.watcher
            for _ in range(500):
                if watcher.dirty:
                    break
                time.sleep(0.01)
        model(torch.ones(1, 3)).sum().backward()
        dist.all_reduce(torch.ones(2))
        opt.step()
        opt.zero_grad()
    monitor.close()
    del os.environ["DYNAMIC_MONITOR"]
    steps = sorted({int(r["step"]) for r in read_family(monitor.run_dir, "comm")})
    return {"patched": patched, "steps": steps, "restored": dist.all_reduce is original}


def _compiled(rank: int, world: int, out_root: str) -> dict:
    """A torch.compile'd model whose forward all-reduces through the functional collectives, compiled at
    step 0 before any step is collected (start_step 1): the collected steps' collectives are seen, with
    the values of the sum over ranks."""
    import torch._dynamo
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from trainermon import TrainerMon

    class Reducing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Reducing()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # ranks keep equal weights (no DDP here)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "compiled")
    path = os.path.join(out_root, f"compiled-{rank}.json")
    with open(path, "w") as fh:
        json.dump({"cc_distribution": {"enable": True}, "ops": OPS, "ndigits": 12, "start_step": 1}, fh)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    run = torch.compile(model, backend="aot_eager")
    want = []
    for step in range(3):
        with torch.no_grad():  # the all-reduced output, from every rank's known input
            want.append(float(sum(model.lin(_x(step, r)) for r in range(world)).double().norm()))
        run(_x(step, rank)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    rows = read_family(monitor.run_dir, "comm")
    torch._dynamo.reset()
    return {"rows": rows, "want": want}


def _megatron(rank: int, world: int, out_root: str) -> dict:
    """Megatron-Core with the distributed optimizer (dp=2): its gradient reduce-scatters and parameter
    all-gathers go through `dist_reduce_scatter_func` / `dist_all_gather_func`, module globals bound to
    torch.distributed's functions at import, seen through the alias scan."""
    from tests.megatron_gpt import Layout, setup, train_step
    from trainermon import TrainerMon

    layout = Layout(dist_opt=True)
    model, optimizer = setup(layout)
    monitor = TrainerMon(_cfg(out_root, "megatron", rank), params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    sumsq = []
    for step in range(2):
        train_step(model, optimizer, layout, step)
        sumsq.append(sum(float(p.detach().double().pow(2).sum()) for c in model for p in c.parameters()))
    probe = monitor.loop.probes[-1]
    monitor.close()
    return {
        "rows": read_family(monitor.run_dir, "comm"),
        "sumsq": sumsq,
        "violations": len(probe.violations),
        "unchecked": probe.unchecked,
    }


def _both(rank: int, world: int, out_root: str) -> dict:
    return {
        "ddp": _ddp(rank, world, out_root),
        "ddp_hook": _ddp_user_hook(rank, world, out_root),
        "fsdp": _fsdp(rank, world, out_root),
        "dynamic": _dynamic(rank, world, out_root),
        "compiled": _compiled(rank, world, out_root),
        "megatron": _megatron(rank, world, out_root),  # last: its CPU shim stays installed
    }


def test_ddp_and_fsdp2_collectives_seen(tmp_path):
    results = run_ranks(_both, world_size=2, out_root=str(tmp_path))
    for res in results:
        mega = res["megatron"]
        assert mega["violations"] == 0 and mega["unchecked"] == 0
        for step, sumsq in enumerate(mega["sumsq"]):
            rows = [r for r in mega["rows"] if r["step"] == str(step)]
            names = {r["name"].split("@")[0] for r in rows}
            assert {"reduce_scatter_tensor/world/output", "all_gather_into_tensor/world/output"} <= names, (
                names
            )
            gathers = [r for r in rows if r["name"].startswith("all_gather_into_tensor/world/output@")]
            got = sum(float(r["norm"]) ** 2 for r in gathers)
            # the step's parameter all-gather holds every updated parameter once (padding is zeros)
            assert abs(got - sumsq) <= 1e-5 * sumsq, (step, got, sumsq, [r["name"] for r in gathers])
        compiled = res["compiled"]
        got = {
            int(r["step"]): float(r["norm"])
            for r in compiled["rows"]
            if r["name"].startswith("funcol.all_reduce/world/output@")
        }
        # step 0 ran before collection began (compiled without the wrappers); steps 1 and 2 are seen
        assert sorted(got) == [1, 2], compiled["rows"]
        for step in (1, 2):
            want = compiled["want"][step]
            assert abs(got[step] - want) <= 1e-5 * want, (step, got[step], want)
        dynamic = res["dynamic"]
        # switched off during step 2: steps 0-2 collected (patched), 3 and 4 run the originals
        assert dynamic["patched"] == [True, True, True, False, False], dynamic
        assert dynamic["steps"] == [0, 1, 2] and dynamic["restored"], dynamic
        for order, got in res["ddp_hook"].items():
            # exact: the delegate runs the user's hook unchanged; seen: its fp16 all-reduces are rows
            assert got["exact"] and "torch.float16" in got["dtypes"], (order, got)
        ddp = res["ddp"]
        assert ddp["violations"] == 0
        calls = []
        for step, want in enumerate(ddp["want"]):
            rows = [
                r
                for r in ddp["rows"]
                if r["step"] == str(step) and r["name"].startswith("all_reduce/world/output@")
            ]
            # DDP's hook runs inside backward(): the call site is the test's backward line
            assert len(rows) == 1 and "test_comm_frameworks.py" in rows[0]["name"], [r["name"] for r in rows]
            got = math.sqrt(sum(float(r["norm"]) ** 2 for r in rows))
            # float32 gradients averaged over 2 ranks: relative error a few float32 ulps
            assert abs(got - want) <= 1e-5 * want, (step, got, want)
            calls.append(int(rows[0]["calls"]))
        # one all-reduce per bucket (DDP rebuilds its small buckets after the first step)
        assert calls[0] >= 1 and calls[1] >= 2, calls
        fsdp = res["fsdp"]
        assert fsdp["violations"] == 0 and fsdp["unchecked"] == 0
        for step, sumsq in enumerate(fsdp["full_sumsq"]):
            rows = [r for r in fsdp["rows"] if r["step"] == str(step)]
            names = {r["name"].split("@")[0] for r in rows}
            # FSDP2's collectives by release: torch 2.13 calls the *_single forms, 2.11 the *_tensor ones
            single = "all_gather_single/world/output" in names
            gather, scatter, full = (
                ("all_gather_single", "reduce_scatter_single", "funcol.all_gather_single")
                if single
                else ("all_gather_into_tensor", "reduce_scatter_tensor", "funcol.all_gather_tensor")
            )
            assert {f"{gather}/world/output", f"{scatter}/world/output"} <= names, names
            assert f"{full}/world/output" in names, names  # DTensor.full_tensor()
            gathers = [r for r in rows if r["name"].startswith(f"{gather}/world/output@")]
            calls = sum(int(r["calls"]) for r in gathers)
            got = sum(float(r["norm"]) ** 2 for r in gathers)
            # every all-gather of the step gathers all parameters (padding is zeros)
            assert abs(got - calls * sumsq) <= 1e-5 * calls * sumsq, (step, got, calls, sumsq)
