"""`cc_log_only` under DDP on 3 gloo ranks: the call-site listing (comm_call_sites.csv) names the explicit
all-reduce; DDP's bucket all-reduces, which run in its C++ reducer, are not listed and one warning says so.
Log-only installs no comm hook on DDP: a Python hook's all-reduce differs from DDP's C++ one in the last
bit with 3 ranks (a session-51 change installed it, and log-only changed the gradients bit for bit). The
full mode names the backward line's and the explicit all-reduce's sites.

Reference, independent of the monitor: the gradients of an identical DDP without any hook."""

from __future__ import annotations

import csv
import json
import logging
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


def _reference(rank: int) -> list[list[torch.Tensor]]:
    """The gradients after each backward of DDP with its own C++ all-reduce (no monitor, no hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), bucket_cap_mb=TINY_BUCKET_MB)
    grads = []
    for step in range(STEPS):
        ddp(_x(rank, step)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        ddp.zero_grad()
    return grads


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
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainermon").addHandler(handler)
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
    logging.getLogger("trainermon").removeHandler(handler)
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
        "said": [m for m in said if "cc_log_only" in m],
    }


def _job(rank: int, world: int, out: str) -> dict:
    grads = _reference(rank)
    log = _monitored(rank, out, "logonly", {"enable": True, "cc_log_only": True})
    full = _monitored(rank, out, "full", {"enable": True})
    pairs = [zip(log["grads"][step], grads[step], strict=True) for step in range(STEPS)]
    same = all(torch.equal(a, b) for step in pairs for a, b in step)
    for res in (log, full):
        del res["grads"]  # tensors do not travel back to the test process (shared-memory handles)
    return {"log": log, "full": full, "same_grads": same}


def _site(line: int) -> str:
    return f"test_comm_log_only_ddp.py:{line}(_monitored)"


def test_log_only_leaves_ddp_alone_and_says_what_it_does_not_list(tmp_path):
    runs = run_ranks(_job, world_size=3, timeout=400, out=str(tmp_path))
    for rank, res in enumerate(runs):
        log, full = res["log"], res["full"]
        listed = {(s["op"], s["group"], s["site"]): int(s["calls"]) for s in log["sites"]}
        explicit = [k for k in listed if k[2].endswith(_site(log["explicit"]))]
        assert len(explicit) == 1 and explicit[0][:2] == ("all_reduce", "world"), (rank, listed)
        assert listed[explicit[0]] == STEPS, (rank, listed)
        assert len(listed) == 1, (rank, listed)  # not DDP's (C++), nor the monitor's own reductions
        assert len(log["said"]) == 1 and "C++ reducer" in log["said"][0], (rank, log["said"])
        assert log["rows"] == []  # log-only writes no statistics
        assert res["same_grads"], rank  # DDP's own all-reduce, bit for bit
        # the full mode sees both: its rows carry the site after '@'
        row_sites = {r["name"].split("@", 1)[1] for r in full["rows"] if r["name"].startswith("all_reduce/")}
        assert len(row_sites) == 2, (rank, row_sites)
        assert any(f":{full['backward']}(_monitored)" in s for s in row_sites), (rank, row_sites)
        assert any(f":{full['explicit']}(_monitored)" in s for s in row_sites), (rank, row_sites)
        assert full["said"] == []


def _reload_job(rank: int, world: int, out: str) -> dict:
    """cc_log_only, then the full mode (steps 2-3), then cc_log_only again (steps 4-5), by dynamic reloads."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    os.environ["DYNAMIC_MONITOR"] = "true"
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, "mon")
    cfg = os.path.join(out, "cfg.json")
    base = {"dynamic_on": True, "collect_times": 100, "ops": ["norm"], "dynamic_watch": "polling"}

    def write(cc: dict) -> None:
        if rank == 0:
            with open(cfg + ".tmp", "w") as fh:
                json.dump({**base, "cc_distribution": cc}, fh)
            os.replace(cfg + ".tmp", cfg)

    write({"enable": True, "cc_log_only": True})
    dist.barrier()
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainermon").addHandler(handler)
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    for step in range(6):
        if step in (2, 4):
            time.sleep(1.1)  # a new modification time
            write({"enable": True} if step == 2 else {"enable": True, "cc_log_only": True})
            if rank == 0:  # the watcher has seen it before the step's poll
                deadline = time.monotonic() + 30
                while not mon.loop.control.watcher.dirty and time.monotonic() < deadline:
                    time.sleep(0.01)
        backward = sys._getframe().f_lineno + 1
        ddp(_x(rank, step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    run_dir = mon.loop.outputs.run_dir
    mon.close()
    logging.getLogger("trainermon").removeHandler(handler)
    with open(os.path.join(run_dir, "comm_call_sites.csv")) as fh:
        sites = [s["site"] for s in csv.DictReader(fh)]
    return {"said": [m for m in said if "cc_log_only" in m], "sites": sites, "backward": backward}


def test_log_only_after_the_full_mode_says_the_delegate_stays(tmp_path):
    """Back in log-only mode after the full mode, DDP keeps the delegate (a comm hook cannot be removed)
    and its all-reduces are listed: the first warning said they are not, so a second says they now are."""
    for rank, res in enumerate(run_ranks(_reload_job, world_size=2, timeout=400, out=str(tmp_path))):
        assert len(res["said"]) == 2, (rank, res["said"])
        assert "C++ reducer" in res["said"][0] and "listed from now on" in res["said"][1], res["said"]
        assert any(s.endswith(f":{res['backward']}(_reload_job)") for s in res["sites"]), (rank, res["sites"])
