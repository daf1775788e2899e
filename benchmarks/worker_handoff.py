"""What the background worker's hand-off costs the training thread: per-step wake-ups vs batches.

Workload (b) of `overhead.py` (48 narrow layers, 194 parameter tensors: a Python-bound step), config
`wg`, arms interleaved in blocks in one process:

- none: no monitor
- per step: trainermon with `write_interval_s` 0 (the worker wakes for every step)
- batched 0.5 s: the default
- batched 2 s
- no hand-off: trainermon with `submit` replaced by a no-op (a stand-in: nothing is written), which is
  the floor the worker's share is measured against

Prints median and mean step overhead with the 90% noise band of the median (see overhead.py).
Run: python benchmarks/worker_handoff.py [--blocks 60]  (about 2 minutes at 60 blocks)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile

import torch
from overhead import build_arm, close_arm, many_workload, overhead_interval, run_step

STEPS_PER_BLOCK = 5
#: (arm, write_interval_s); None: the hand-off itself is removed
ARMS = (("per step", 0.0), ("batched 0.5 s", 0.5), ("batched 2 s", 2.0), ("no hand-off", None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = many_workload()
    with tempfile.TemporaryDirectory(prefix="tm-handoff-") as out_dir:
        arms = {"none": build_arm(work, "none", "-", out_dir)}
        for name, interval in (
            ("per step", 0.0),
            ("batched 0.5 s", 0.5),
            ("batched 2 s", 2.0),
            ("no hand-off", None),
        ):
            arm = build_arm(work, "trainermon", "wg", out_dir)
            if interval is None:
                arm.monitor.loop.worker.submit = lambda payload: True
            else:
                arm.monitor.loop.worker.set_interval(interval)
            arms[name] = arm
        try:
            for arm in arms.values():
                run_step(arm)
                arm.times.clear()
                arm.own.clear()
            rng = random.Random(args.seed)
            order = list(arms.values())
            for _ in range(args.blocks):
                rng.shuffle(order)
                for arm in order:
                    for _ in range(STEPS_PER_BLOCK):
                        run_step(arm)
        finally:
            for arm in arms.values():
                close_arm(arm)
    base = arms["none"].times
    median_base, mean_base = statistics.median(base), statistics.fmean(base)
    band_rng = random.Random(args.seed + 1)
    print(f"(b) wg, {args.blocks} blocks x {STEPS_PER_BLOCK} steps; baseline {median_base * 1e3:.1f} ms/step")
    print(f"{'arm':15} {'median %':>9} {'90% band':>13} {'mean %':>8} {'own ms':>7}")
    for name, arm in arms.items():
        if name == "none":
            continue
        low, high = overhead_interval(arm.times, base, STEPS_PER_BLOCK, band_rng)
        print(
            f"{name:15} {(statistics.median(arm.times) / median_base - 1) * 100:>9.2f} "
            f"{f'{low:.1f}..{high:.1f}':>13} {(statistics.fmean(arm.times) / mean_base - 1) * 100:>8.2f} "
            f"{statistics.median(arm.own) * 1e3:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
