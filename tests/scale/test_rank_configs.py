"""Ranks whose config files differ as they start (a node's stale copy, an edit landing while the ranks
start), on 2 gloo ranks, one launch: every rank runs rank 0's config, said on the rank that differs.

- Static mode: rank 1 reading other `ops` used to meet rank 0 in collectives of other sizes (the
  cross-rank summaries): gloo aborted the process (`Received data size doesn't match expected size`).
- Dynamic mode: rank 1 opened its sinks with its own config, then renewed its run directory when rank 0's
  arrived: another `{time}` than rank 0's, and an empty directory left behind.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family


def _run(rank: int, out: str, dynamic: bool, same: bool = False) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ["DYNAMIC_MONITOR"] = "true" if dynamic else "false"
    cfg = os.path.join(out + f"-cfg{rank}.json")
    ops = ["norm", "max"] if rank == 0 or same else ["mean"]
    with open(cfg, "w") as fh:
        json.dump({"xy_distribution": not same, "ops": ops, "dynamic_on": True, "collect_times": 100}, fh)
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainermon").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    if same:  # the same file everywhere, activations switched on by msprobe's call before set_monitor
        mon.reload_xy(True)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    logging.getLogger("trainermon").removeHandler(handler)
    return {"run_dir": mon.run_dir, "faults": mon.faults.total, "said": said}


def _skewed(rank: int, out: str) -> list[str]:
    """Dynamic mode, rank 1's clock an hour ahead: a config edit that changes the columns gives every
    rank a new run directory. Its `{time}` was each rank's own clock: the ranks' directories of one job
    went by different names. The run directories each rank wrote, in order."""
    import time as real_time
    import types

    import trainermon.runtime.outputs as outputs
    from trainermon import TrainerMon

    if rank == 1:
        outputs.time = types.SimpleNamespace(time=lambda: real_time.time() + 3600)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ["DYNAMIC_MONITOR"] = "true"
    cfg = os.path.join(out + f"-cfg{rank}.json")
    body = {"xy_distribution": True, "ops": ["norm"], "dynamic_on": True, "collect_times": 100}
    with open(cfg, "w") as fh:
        json.dump(body, fh)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    dirs = []
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        dirs.append(mon.run_dir)
        if step == 0 and rank == 0:
            with open(cfg, "w") as fh:
                json.dump({**body, "ops": ["norm", "max"]}, fh)
            mon.loop.control.watcher.dirty = True  # the watcher's event, without waiting for it
    mon.close()
    outputs.time = real_time
    return dirs


def _job(rank: int, world: int, out: str) -> dict:
    runs = {mode: _run(rank, os.path.join(out, mode), mode == "dynamic") for mode in ("static", "dynamic")}
    runs["skewed"] = _skewed(rank, os.path.join(out, "skewed"))
    return runs | {"same": _run(rank, os.path.join(out, "same"), False, same=True)}


def test_every_rank_runs_rank_0s_config(tmp_path):
    results = run_ranks(_job, world_size=2, timeout=300, out=str(tmp_path))
    for mode in ("static", "dynamic"):
        ranks = [res[mode] for res in results]
        for rank, res in enumerate(ranks):
            assert res["faults"] == 0, (mode, res)
            differs = [line for line in res["said"] if "differs from rank 0's" in line]
            assert len(differs) == (1 if rank == 1 else 0), (mode, rank, res["said"])
            assert rank == 0 or "(keys ops)" in differs[0], differs  # which keys: a node's stale copy
            rows = read_family(res["run_dir"], "actv")
            assert rows and all(set(r) >= {"norm", "max"} and "mean" not in r for r in rows), (mode, rank)
        dirs = sorted(os.path.basename(d) for d in glob.glob(os.path.join(tmp_path, mode, "*rank*")))
        assert dirs == sorted(os.path.basename(r["run_dir"]) for r in ranks), (mode, dirs)  # none left empty
        stamps = {os.path.basename(r["run_dir"]).split("-rank")[0] for r in ranks}
        assert len(stamps) == 1, (mode, stamps)  # one `{time}` on every rank
        assert read_family(ranks[0]["run_dir"], "xrank"), mode
    # the renewed directories carry rank 0's clock on every rank
    dirs = [[os.path.basename(d).split("-rank")[0] for d in r["skewed"]] for r in results]
    assert dirs[0] == dirs[1] and dirs[0][0] != dirs[0][-1], dirs
    for rank, res in enumerate(r["same"] for r in results):  # nothing differs: reload_xy holds, nothing said
        assert not [line for line in res["said"] if "differs" in line], res["said"]
        assert read_family(res["run_dir"], "actv"), rank
