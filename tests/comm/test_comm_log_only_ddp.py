"""`cc_log_only` under DDP on 2 gloo ranks: the call-site listing (comm_call_sites.csv) names DDP's bucket
all-reduces at the user's backward line, one call per bucket per collected step, next to the explicit
all-reduce, and under the same site as the rows of the full mode. DDP runs its all-reduces in the C++
reducer; the listing used to leave them out, since the delegating comm hook that routes them through
`torch.distributed` was not installed in log-only mode.

References, independent of the monitor: the bucket all-reduce count is what a counting comm hook sees on
an identical DDP (a bucket cap below any parameter's size: after DDP's first backward, which rebuilds its
buckets, one bucket per parameter), and the gradients
after each backward are that DDP's (the delegate runs the same default all-reduce, so equal bit for bit)."""

from __future__ import annotations

import csv
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

STEPS = 3
TINY_BUCKET_MB = 1e-6  # ~1 byte: each parameter its own bucket once DDP has rebuilt them


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _reference(rank: int) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Bucket all-reduces per backward and the gradients, from DDP with a counting hook (no monitor)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), bucket_cap_mb=TINY_BUCKET_MB)
    calls = [0]

    def counting(state, bucket):  # DDP checks the parameter is named `bucket`
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    counts, grads = [], []
    for step in range(STEPS):
        calls[0] = 0
        ddp(_x(rank, step)).pow(2).mean().backward()
        counts.append(calls[0])
        grads.append([p.grad.clone() for p in ddp.parameters()])
        ddp.zero_grad()
    return counts, grads


def _monitored(rank: int, out: str, tag: str, cc: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, tag)
    cfg = os.path.join(out, f"{tag}-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"cc_distribution": cc, "ops": ["norm", "mean", "min", "max"]}, fh)
    ddp = DDP(_model(), bucket_cap_mb=TINY_BUCKET_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)  # lr 0: every step's gradients as the reference's
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    grads = []
    for step in range(STEPS):
        backward = sys._getframe().f_lineno + 1
        ddp(_x(rank, step)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        explicit = sys._getframe().f_lineno + 1
        dist.all_reduce(torch.full((3,), float(rank + 1)))
        opt.step()
        opt.zero_grad()
    run_dir = mon.loop.outputs.run_dir
    mon.close()
    sites = []
    if os.path.exists(os.path.join(run_dir, "comm_call_sites.csv")):
        with open(os.path.join(run_dir, "comm_call_sites.csv")) as fh:
            sites = list(csv.DictReader(fh))
    return {
        "sites": sites,
        "rows": read_family(run_dir, "comm"),
        "grads": grads,
        "backward": backward,
        "explicit": explicit,
    }


def _job(rank: int, world: int, out: str) -> dict:
    counts, grads = _reference(rank)
    log = _monitored(rank, out, "logonly", {"enable": True, "cc_log_only": True})
    full = _monitored(rank, out, "full", {"enable": True})
    pairs = [zip(log["grads"][step], grads[step], strict=True) for step in range(STEPS)]
    same = all(torch.equal(a, b) for step in pairs for a, b in step)
    for res in (log, full):
        del res["grads"]  # tensors do not travel back to the test process (shared-memory handles)
    return {"counts": counts, "log": log, "full": full, "same_grads": same}


def _site(line: int) -> str:
    return f"test_comm_log_only_ddp.py:{line}(_monitored)"


def test_log_only_lists_ddp_bucket_all_reduces(tmp_path):
    runs = run_ranks(_job, world_size=2, timeout=400, out=str(tmp_path))
    for rank, res in enumerate(runs):
        log, full = res["log"], res["full"]
        # DDP's first backward uses its initial layout (one bucket here), the rebuilt one a bucket per
        # parameter (4): more calls than steps, so a count per step rather than per bucket would show
        assert sum(res["counts"]) > STEPS, res["counts"]
        listed = {(s["op"], s["group"], s["site"]): int(s["calls"]) for s in log["sites"]}
        backward = [k for k in listed if k[2].endswith(_site(log["backward"]))]
        explicit = [k for k in listed if k[2].endswith(_site(log["explicit"]))]
        assert len(backward) == 1 and backward[0][:2] == ("all_reduce", "world"), (rank, listed)
        assert listed[backward[0]] == sum(res["counts"]), (rank, listed)  # calls over the collected steps
        assert len(explicit) == 1 and explicit[0][:2] == ("all_reduce", "world"), (rank, listed)
        assert listed[explicit[0]] == STEPS, (rank, listed)
        assert len(listed) == 2, (rank, listed)  # nothing else: the monitor's own reductions are not listed
        assert log["rows"] == []  # log-only writes no statistics
        assert res["same_grads"], rank  # the delegate's all-reduce is DDP's default, bit for bit
        # the full mode names the same two sites (its rows carry the site after '@')
        row_sites = {r["name"].split("@", 1)[1] for r in full["rows"] if r["name"].startswith("all_reduce/")}
        assert len(row_sites) == 2, (rank, row_sites)
        assert {s for s in row_sites if backward[0][2].endswith(s)}, (rank, row_sites, backward)
        assert {s for s in row_sites if explicit[0][2].endswith(s)}, (rank, row_sites, explicit)
