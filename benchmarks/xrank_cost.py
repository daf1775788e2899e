"""Per-step cost of the cross-rank summaries (`trainermon.collect.xrank.CrossRank.reduce`) on gloo ranks
(loopback, CPU), for a given number of per-rank rows: the layout check, the packed reduction and the
packing, after the layout is agreed (the first call, which also agrees it, is reported apart).

Run: python benchmarks/xrank_cost.py [--world 4] [--rows 100 1000 10000] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STATS = ("norm", "mean", "min", "max")


def _worker(rank: int, world: int, port: int, rows: list[int], steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainermon.collect.records import RowMeta
    from trainermon.collect.xrank import CrossRank
    from trainermon.stats import empty_partials

    results = {}
    for n in rows:
        xrank = CrossRank(rank, world)
        xrank.attach()
        metas = [RowMeta("grad_unreduced", 0, f"layers.{i // 12}.p{i % 12}", None, (64,), torch.float32, 64)
                 for i in range(n)]  # fmt: skip
        parts = [empty_partials(n)]
        parts[0][:, 0] = torch.rand(n)
        dist.barrier()
        t0 = time.perf_counter()
        xrank.reduce(metas, parts, STATS)
        first = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            dist.barrier()  # the ranks reach the step's end together, as after a real step
            t0 = time.perf_counter()
            xrank.reduce(metas, parts, STATS)
            times.append(time.perf_counter() - t0)
        results[n] = {"first_ms": first * 1e3, "median_ms": statistics.median(times) * 1e3,
                      "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}  # fmt: skip
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"world": world, "steps": steps, "stats": STATS, "results": results}, fh, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "xrank.json")
    mp.spawn(_worker, args=(args.world, port, args.rows, args.steps, out), nprocs=args.world)
    with open(out) as fh:
        print(fh.read())


if __name__ == "__main__":
    main()
