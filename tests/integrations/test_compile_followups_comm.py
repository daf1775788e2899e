"""cc_distribution sees the gradient all-reduces of a DDP that `set_monitor` does not get directly, on 2 gloo
ranks: `torch.compile(DDP(m))` passed to set_monitor, `set_monitor(m)` while `DDP(m)` trains, and a DDP made
after set_monitor (found at the end of the first collected step, watched from the next). The probe shared
the comm-hook slot only of a DDP among the chunks themselves, so DDP's all-reduces (run in its C++ reducer)
made no row.

The reference: each rank's local gradient from a non-DDP copy fed the same data, all-reduced by the test
itself. DDP's default hook divides each bucket by the world size and all-reduces it in place: the output
rows of the step's backward hold every bucket, the averaged gradient."""

from __future__ import annotations

import copy
import json
import math
import os

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import read_family

STEPS = 3
# "compiled_ddp": torch.compile(DDP(m)) trains and is passed; "inner": m passed while DDP(m) trains;
# "inner_late": m passed, DDP(m) made after set_monitor
CASES = ("compiled_ddp", "inner", "inner_late")


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _average(local: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """The test's own all-reduce (its rows name this function: told apart from DDP's, made in `_case`)."""
    averaged = [t / world for t in local]
    for t in averaged:
        dist.all_reduce(t)
    return averaged


def _case(rank: int, world: int, out_root: str, case: str) -> dict:
    from trainermon import TrainerMon

    torch._dynamo.reset()
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, case)
    cfg = os.path.join(out_root, f"{case}-rank{rank}.json")
    with open(cfg, "w") as fh:
        # wg_distribution: the adapter looks for a late DDP at the end of a step that reads gradients
        conf = {"cc_distribution": {"enable": True}, "wg_distribution": True, "ops": ["norm"], "ndigits": 12}
        json.dump(conf, fh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    if case == "inner_late":
        monitor.set_monitor(model, optimizer=opt)
    # small buckets (several all-reduces per backward), but where dynamo's DDPOptimizer splits the graph
    # at buckets, which wants DDP's first bucket no larger than the others
    ddp = DDP(model) if case == "compiled_ddp" else DDP(model, bucket_cap_mb=0.0001)
    run = torch.compile(ddp, backend="aot_eager") if case == "compiled_ddp" else ddp
    if case != "inner_late":
        monitor.set_monitor(run if case == "compiled_ddp" else model, optimizer=opt)

    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    want: dict[
        int, float
    ] = {}  # step -> the norm of the step's averaged gradient (DDP's all-reduces' output)
    for step in range(STEPS):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        x = torch.randn(3, 4, generator=gen)
        run(x).square().sum().backward()
        reference(x).square().sum().backward()
        averaged = _average([p.grad for p in reference.parameters()], world)
        for p, q in zip(averaged, model.parameters()):
            torch.testing.assert_close(q.grad, p)  # DDP did reduce
        want[step] = _norm(averaged)
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    return {"rows": read_family(monitor.run_dir, "comm"), "want": want}


def _all_cases(rank: int, world: int, out_root: str) -> dict:
    return {case: _case(rank, world, out_root, case) for case in CASES}


def test_cc_distribution_sees_the_ddp_the_adapter_found(tmp_path):
    results = run_ranks(_all_cases, world_size=2, out_root=str(tmp_path))
    for rank, res in enumerate(results):
        for case, got in res.items():
            # a DDP made after set_monitor is found at the end of step 0: its all-reduces are seen from step 1
            first = 1 if case == "inner_late" else 0
            # DDP's hook runs inside backward(): its call site is the backward line of `_case`
            rows = [r for r in got["rows"] if r["name"].startswith("all_reduce/world/output@")]
            rows = [r for r in rows if r["name"].endswith("(_case)")]
            assert {int(r["step"]) for r in rows} == set(range(first, STEPS)), (rank, case, got["rows"])
            for step in range(first, STEPS):
                mine = [r for r in rows if r["step"] == str(step)]
                norm = math.sqrt(sum(float(r["norm"]) ** 2 for r in mine))
                want = got["want"][step]
                assert abs(norm - want) <= 1e-5 * want, (rank, case, step, norm, want)
                # one all-reduce per bucket: one at step 0 (DDP's first bucket is 1 MiB), then several small
                # ones once DDP rebuilds them (the compiled DDP keeps default buckets)
                calls = sum(int(r["calls"]) for r in mine)
                assert calls >= (1 if case == "compiled_ddp" or step == 0 else 2), (rank, case, step, calls)
