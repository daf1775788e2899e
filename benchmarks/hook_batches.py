"""Where hook tensors are reduced, side by side (issue 23): `all` on the many-module workloads.

Arms, all in one process, interleaved in blocks in a fresh random order (the method of overhead.py):
no monitor; trainermon `all` as shipped (a tensor the native kernel reads is reduced at its hook, into
the step's row table); `all` batched (`StepCollector.at_hook = False`: hook tensors recorded by reference
and reduced in batches, what accelerators do); `all` per hook (`at_hook` and `batching` off: one engine
call per hook); trainermon `wg+mv+param`. Medians with the 90% block-bootstrap band.

    PYTHONPATH=. python benchmarks/hook_batches.py --workloads b,c --blocks 12 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import overhead as ov  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="b,c")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--json", default=os.path.join(os.path.dirname(__file__), "hook_batches_results_at_hook.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    works = {"b": ov.many_workload(), "c": ov.moe_workload()}
    rng = random.Random(0)
    out = {"load_average_start": os.getloadavg(), "workloads": {}}
    for key in args.workloads.split(","):
        work = works[key]
        with tempfile.TemporaryDirectory() as tmp:
            for sub in ("x", "y", "z"):
                os.makedirs(os.path.join(tmp, sub))
            arms = {
                "none": ov.build_arm(work, "none", "-", tmp),
                "all (at hook)": ov.build_arm(work, "trainermon", "all", os.path.join(tmp, "z")),
                "all (batched)": ov.build_arm(work, "trainermon", "all", os.path.join(tmp, "x")),
                "all (per hook)": ov.build_arm(work, "trainermon", "all", os.path.join(tmp, "y")),
                "wg+mv+param": ov.build_arm(work, "trainermon", "wg+mv+param", tmp),
            }
            arms["all (batched)"].monitor.loop.collector.at_hook = False
            arms["all (per hook)"].monitor.loop.collector.at_hook = False
            arms["all (per hook)"].monitor.loop.collector.batching = False
            for arm in arms.values():
                ov.run_step(arm)
                arm.times.clear()
                arm.own.clear()
            names = list(arms)
            for _ in range(args.blocks):
                rng.shuffle(names)
                for name in names:
                    for _ in range(args.steps):
                        ov.run_step(arms[name])
            base = statistics.median(arms["none"].times)
            rows = {}
            for name, arm in arms.items():
                med = statistics.median(arm.times)
                band = ov.overhead_interval(arm.times, arms["none"].times, args.steps, rng)
                own = statistics.median(arm.own) * 1e3 if arm.own else None
                rows[name] = {
                    "median_ms": med * 1e3,
                    "overhead_pct": (med / base - 1) * 100,
                    "band_pct": band,
                    "own_ms": own,
                    "engine_calls": arm.monitor.loop.engine.calls if arm.monitor else None,
                }
                own_text = "-" if own is None else f"{own:.2f}"
                print(
                    f"({key}) {name:16s} {med * 1e3:8.1f} ms  {rows[name]['overhead_pct']:+7.1f}%"
                    f"  band {band[0]:+.1f}..{band[1]:+.1f}  own {own_text} ms",
                    flush=True,
                )
            for arm in arms.values():
                ov.close_arm(arm)
        out["workloads"][key] = {"title": work.title, "baseline_ms": base * 1e3, "arms": rows}
    out["load_average_end"] = os.getloadavg()
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print("load average", out["load_average_start"], "->", out["load_average_end"])


if __name__ == "__main__":
    main()
