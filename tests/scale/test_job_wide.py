"""One real 4-rank job (gloo, DDP): the job-wide run id in every sink.

All checks of the 4-rank run share one launch (spawning ranks is the expensive part)."""

from __future__ import annotations

import glob
import json
import os
import urllib.request

import pyarrow.dataset as ds
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks

WORLD = 4
STEPS = 3
NAN_RANK, NAN_STEP = 3, 2
OPS = ["norm", "mean", "min", "max", "nans", "infs"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _job(rank: int, world: int, out: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"config-rank{rank}.json")
    os.makedirs(out, exist_ok=True)
    with open(cfg, "w") as fh:
        json.dump(
            {
                "xy_distribution": True,
                "wg_distribution": True,
                "ops": OPS,
                "ndigits": 17,
                "format": ["csv", "parquet", "prometheus"],
                "write_interval_s": 0,
            },
            fh,
        )
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data: per-rank rows differ
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=gen)
        if rank == NAN_RANK and step == NAN_STEP:
            x[0, 0] = float("nan")  # rank 3's own activations and pre-reduce gradients go non-finite
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.flush()
    with open(os.path.join(monitor.run_dir, "prometheus.json")) as fh:
        url = json.load(fh)["url"]
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    sd = sorted(glob.glob(os.path.join(out, "prometheus_sd", f"rank{rank}-*.json")))
    sd_labels = [json.load(open(p))[0]["labels"] for p in sd]
    run_dir = monitor.run_dir
    monitor.close()
    return {"run_dir": run_dir, "page": page, "sd_labels": sd_labels}


def test_four_rank_job(tmp_path):
    out = str(tmp_path / "out")
    results = run_ranks(_job, world_size=WORLD, timeout=300, out=out)

    # ---- one run id for the whole job, in every sink ----------------------------------------------
    names = [os.path.basename(r["run_dir"]) for r in results]
    ids = {n.rsplit("-", 1)[-1] for n in names}
    assert len(ids) == 1, names
    run_id = ids.pop()
    for rank, name in enumerate(names):
        # msprobe's layout: {time}-rank{R}-{id}, and rank 0's start time on every rank
        assert name == f"{names[0].split('-rank')[0]}-rank{rank}-{run_id}"
    table = ds.dataset(os.path.join(out, "parquet"), partitioning="hive").to_table()
    assert set(table.column("run_id").to_pylist()) == {run_id}
    assert set(table.column("rank").to_pylist()) == set(range(WORLD))
    for rank, r in enumerate(results):
        info = [
            s.labels
            for fam in text_string_to_metric_families(r["page"])
            for s in fam.samples
            if s.name == "trainermon_info"
        ]
        assert [i["run_id"] for i in info] == [run_id] and info[0]["rank"] == str(rank)
        # the file_sd target label, which Prometheus puts on every series it scrapes from the rank
        assert r["sd_labels"] == [{"run_id": run_id}]
