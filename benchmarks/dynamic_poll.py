"""Per-step cost of dynamic mode's rank-consistent control on 2 gloo ranks (loopback).

Each step boundary, rank 0 checks the watcher's flag and broadcasts [version, length, clock] (24 bytes)
over a gloo group; this measures that call (`DynamicControl.poll`) with no config change, median over many
steps. Run: python benchmarks/dynamic_poll.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, path: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainermon.config import load_config
    from trainermon.runtime.control import DynamicControl

    control = DynamicControl(path, load_config(path))
    control.attach()
    times = []
    for _ in range(steps):
        dist.barrier()  # the ranks reach the boundary together, as after a real step
        t0 = time.perf_counter()
        control.poll()
        times.append(time.perf_counter() - t0)
    control.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(
                {
                    "median_us": statistics.median(times) * 1e6,
                    "p90_us": sorted(times)[int(0.9 * steps)] * 1e6,
                },
                fh,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cfg.json")
        with open(path, "w") as fh:
            json.dump({"dynamic_on": False, "wg_distribution": True}, fh)
        out = os.path.join(tmp, "result.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(2, port, path, args.steps, out), nprocs=2, join=True)
        result = json.load(open(out))
    print(
        f"dynamic control poll, 2 gloo ranks: median {result['median_us']:.1f} us, "
        f"p90 {result['p90_us']:.1f} us per step"
    )


if __name__ == "__main__":
    main()
