"""The garbage collector's time per training step, with and without the monitor (issue 23).

    python benchmarks/gc_cost.py [--workloads b,c] [--arms none,wg+mv+param,all] [--steps 60]

Each (workload, arm) runs in a fresh process (the collector's state is process-wide): the overhead
benchmark's model and step (`benchmarks/overhead.py`), 5 warm-up steps, then `--steps` steps, each timed,
with `gc.callbacks` timing every collection and counting full (generation 2) ones. Printed per arm: the
median and mean step, the mean collection time per step, and the full collections. Why it matters: objects
that outlive young collections are promoted, and enough promotions make CPython run a full collection,
which walks the whole heap of a training process (torch, dynamo and the model: ~140 ms on (c) here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import gc, json, logging, os, statistics, sys, tempfile, time
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks")); sys.path.insert(0, sys.argv[1])
import torch
import overhead as ov
torch.set_num_threads(1)
logging.getLogger("trainermon").setLevel(logging.ERROR)
workload, arm_name, steps = sys.argv[2], sys.argv[3], int(sys.argv[4])
work = ov._workloads(False)[workload]
tool = "none" if arm_name == "none" else "trainermon"
arm = ov.build_arm(work, tool, "-" if tool == "none" else arm_name, tempfile.mkdtemp())
state = {"start": 0.0, "spent": 0.0, "full": 0}
def watch(phase, info):
    if phase == "start":
        state["start"] = time.perf_counter()
    else:
        state["spent"] += time.perf_counter() - state["start"]
        state["full"] += info["generation"] == 2
gc.callbacks.append(watch)
for _ in range(5):
    ov.run_step(arm)
state.update(spent=0.0, full=0)
times = []
for _ in range(steps):
    start = time.perf_counter()
    ov.run_step(arm)
    times.append(time.perf_counter() - start)
print(json.dumps({"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3,
                  "gc_ms_per_step": state["spent"] / steps * 1e3, "full_collections": state["full"]}))
ov.close_arm(arm)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="b,c")
    parser.add_argument("--arms", default="none,wg+mv+param,all")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {}
    for workload in args.workloads.split(","):
        for arm in args.arms.split(","):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.tree, workload, arm, str(args.steps)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[f"{workload}/{arm}"] = row
            print(
                f"({workload}) {arm:12s} median {row['median_ms']:7.1f} ms  mean {row['mean_ms']:7.1f} ms"
                f"  gc {row['gc_ms_per_step']:6.2f} ms/step  full collections {row['full_collections']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"steps": args.steps, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
