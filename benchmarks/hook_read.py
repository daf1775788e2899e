"""What one hook tensor costs to reduce, by where it is reduced (issue 23): at its hook through a
one-tensor engine call, at its hook through `StatsEngine.kernel_row` into a row table (what hooks do
where the native kernel is built), or later in a batch read back from memory.

    PYTHONPATH=. python benchmarks/hook_read.py [--rows 512] [--cols 128] [--reps 2000]

The tensor is the output of an op run just before (gelu(x @ w), float32, 256 KiB by default: one
activation of workload (b)), as a forward hook sees it. The batch arm reduces 400 such tensors made
earlier in one engine call and reports the time per tensor. One thread; medians over `--reps`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainermon.collect.batch import RowTable
from trainermon.stats import EngineOptions, StatsEngine, fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not fused.AVAILABLE:
        raise SystemExit(f"the native kernel is needed for this comparison: {fused.KIND}")
    engine = StatsEngine(EngineOptions())
    x = torch.randn(args.rows, args.cols)
    w = torch.randn(args.cols, args.cols)

    def fresh() -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w)

    def one_call() -> float:
        t = fresh()
        start = time.perf_counter()
        engine.compute_rows([t])
        return time.perf_counter() - start

    table = RowTable()

    def at_hook() -> float:
        t = fresh()
        start = time.perf_counter()
        table.used = 0
        table.write(engine, t)
        return time.perf_counter() - start

    made = [fresh() for _ in range(400)]

    def batch() -> float:
        start = time.perf_counter()
        engine.compute_rows(made)
        return (time.perf_counter() - start) / len(made)

    nbytes = args.rows * args.cols * 4
    for name, arm, reps in (("one engine call", one_call, args.reps), ("kernel_row", at_hook, args.reps),
                            ("batch of 400, per tensor", batch, max(10, args.reps // 40))):  # fmt: skip
        arm()
        median = statistics.median(arm() for _ in range(reps))
        print(f"{name:26s} {median * 1e6:7.1f} us  {nbytes / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
