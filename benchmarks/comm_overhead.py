"""What `cc_distribution` costs a training step: 2-rank DDP and 2-rank FSDP2 (gloo, loopback, CPU).

Arms, each in its own 2-rank launch (two monitors in one process would share the patched
torch.distributed), launches alternated off/on `--rounds` times so that load from other jobs falls on both:

    off        TrainerMon attached, cc_distribution disabled (DDP keeps its built-in C++ all-reduce)
    off, DDP Python hook   the same, with DDP's default all-reduce hook registered (what `on` registers)
    on         TrainerMon with cc_distribution enabled, step_interval 2: even steps are collected
               ("on, collected": statistics of every collective, the packed check reduction, the rows)
               and odd steps are not ("on, idle": no patch installed; for DDP the default all-reduce
               hook the monitor registered runs in Python instead of the built-in reducer)

A step is the slower rank's forward + backward + optimizer step (per-step times gathered at the end).
Figures: medians over all timed steps of an arm, and a 90% bootstrap band of the median difference
(steps resampled 2000 times). Run: python benchmarks/comm_overhead.py [--steps 40 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(512, 8))


def _worker(
    rank: int, world: int, port: int, kind: str, enabled: bool, steps: int, tmp: str, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MONITOR_OUTPUT_DIR=tmp)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from trainermon import TrainerMon

    model = _model()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=1)
        if enabled == "hook":  # DDP's default all-reduce hook alone, as cc_distribution registers it
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = os.path.join(tmp, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {"cc_distribution": {"enable": enabled is True}, "step_interval": 2, "ops": ["norm", "max"]}, fh
        )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    monitor.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        slowest = [max(ts) for ts in zip(*gathered)]
        with open(out, "w") as fh:
            json.dump(slowest[2:], fh)  # the first two steps warm up (bucket rebuild, allocations)
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, enabled: bool | str, steps: int) -> list[float]:
    for attempt in range(3):  # a rank that dies at teardown (gloo, loaded machine) after writing is fine
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            try:
                mp.spawn(_worker, args=(2, _port(), kind, enabled, steps, tmp, out), nprocs=2, join=True)
            except mp.ProcessExitedException as exc:
                print(f"launch {kind} enabled={enabled} attempt {attempt}: {exc}")
            if os.path.exists(out):
                with open(out) as fh:
                    return json.load(fh)
    raise RuntimeError(f"{kind} enabled={enabled}: no result after 3 launches")


def _band(a: list[float], b: list[float], rng: random.Random) -> tuple[float, float]:
    diffs = sorted(
        statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
        for _ in range(2000)
    )
    return diffs[100], diffs[1899]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    results = {}
    for kind in ("ddp", "fsdp2"):
        arms: dict[str, list[float]] = {"off": [], "on, idle": [], "on, collected": []}
        if kind == "ddp":
            arms["off, DDP Python hook"] = []
        for _ in range(args.rounds):
            arms["off"] += _launch(kind, False, args.steps)
            if kind == "ddp":
                arms["off, DDP Python hook"] += _launch(kind, "hook", args.steps)
            on = _launch(kind, True, args.steps)
            # timed steps start at step 2 (collected): even positions collected, odd idle
            arms["on, collected"] += on[0::2]
            arms["on, idle"] += on[1::2]
        base = statistics.median(arms["off"])
        summary = {}
        for arm, ts in arms.items():
            med = statistics.median(ts)
            lo, hi = _band(arms["off"], ts, rng) if arm != "off" else (0.0, 0.0)
            summary[arm] = {
                "steps": len(ts),
                "median_ms": round(med * 1e3, 2),
                "overhead_ms": round((med - base) * 1e3, 2),
                "overhead_band_ms": [round(lo * 1e3, 2), round(hi * 1e3, 2)],
                "overhead_pct": round((med / base - 1) * 100, 1),
            }
        results[kind] = summary
        print(kind, json.dumps(summary, indent=1))
    path = os.path.join(os.path.dirname(__file__), "comm_overhead_results.json")
    with open(path, "w") as fh:
        json.dump({"args": vars(args), "load_before": os.getloadavg(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
