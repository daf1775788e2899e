"""torch.compile with and without the monitor: steady-state step time, graphs compiled, graph breaks.

    PYTHONPATH=. python benchmarks/bench_compile.py [--backend inductor] [--steps 60]

Three runs of the same compiled MLP (8 Linear+GELU layers, width 256, batch 64, CPU): no monitor; the
monitor with xy_distribution on every step; the monitor with xy_distribution scheduled but no step
collected (start_step beyond the run). Step times are after a warm-up that covers the first collected
step's recompile; the median and the 10-90 percentile band are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def run(mode: str, backend: str, steps: int, out: Path) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainermon import TrainerMon

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = None
    if mode != "off":
        cfg = out / f"{mode}.json"
        keys = {"xy_distribution": True, "ops": ["norm", "min", "max"]}
        if mode == "idle":
            keys["start_step"] = 10**9
        cfg.write_text(json.dumps(keys))
        monitor = TrainerMon(str(cfg))
        monitor.set_monitor(model, optimizer=opt)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(64, 256)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if monitor is not None:
        monitor.close()
    steady = sorted(times[steps // 3 :])
    n = len(steady)
    return {
        "mode": mode,
        "median_ms": 1e3 * statistics.median(steady),
        "p10_ms": 1e3 * steady[n // 10],
        "p90_ms": 1e3 * steady[(9 * n) // 10],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        import os

        os.environ.setdefault("MONITOR_OUTPUT_DIR", tmp)
        for mode in ("off", "idle", "every"):
            result = run(mode, args.backend, args.steps, Path(tmp))
            print(json.dumps(result))


if __name__ == "__main__":
    main()
