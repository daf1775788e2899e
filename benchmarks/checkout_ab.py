"""A/B two checkouts of trainermon on one overhead workload: step time and the monitor's own time.

    python benchmarks/checkout_ab.py /tmp/before /path/to/after --workload b --runs 3

Each checkout must have its kernel built in place (`python setup.py build_ext --inplace`) and, so that
its own adapters and exporters are imported, `trainermon/adapters` and `trainermon/exporters` symlinked to
its `adapters/` and `exporters/`. Method: for each run, one fresh process per checkout (alternating
checkouts), each running the arms none and trainermon under each config side by side, with the checkout's
own `benchmarks/overhead.py` (`build_arm`, `run_step`): 5 warm-up steps per arm, then `--blocks` blocks of
5 steps per arm in a fresh random order per block, one torch thread. Prints, per checkout and run, the
median step time, median own time and mean step time per arm (ms), then the medians over runs. The mean
holds what the median leaves out: the background worker writes every `write_interval_s`, so its share of
the GIL falls on one step in several.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, logging, os, random, statistics, sys, tempfile
tree, workload, configs, blocks = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
sys.path.insert(0, os.path.join(tree, "benchmarks")); sys.path.insert(0, tree)
import torch
import overhead as ob
torch.set_num_threads(1)
logging.getLogger("trainermon").setLevel(logging.ERROR)
work = ob._workloads(False)[workload]
ob._LOSS = work.loss  # older checkouts' run_step reads this global; newer ones use the arm's own loss
out = tempfile.mkdtemp()
arms = [ob.build_arm(work, "none", "-", out)] + [ob.build_arm(work, "trainermon", c, out) for c in configs]
for arm in arms:
    for _ in range(5):
        ob.run_step(arm)
    arm.times.clear(); arm.own.clear()
for _ in range(blocks):
    random.shuffle(arms)
    for arm in arms:
        for _ in range(5):
            ob.run_step(arm)
def med(xs):
    return statistics.median(xs) * 1e3 if xs else None
result = {a.name: [med(a.times), med(a.own), statistics.mean(a.times) * 1e3] for a in arms}
for arm in arms:
    ob.close_arm(arm)
print(json.dumps(result))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--workload", default="b", choices=("a", "b", "c"))
    parser.add_argument("--configs", default="wg+mv+param,all")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {args.before: [], args.after: []}
    for run in range(args.runs):
        for tree in (args.before, args.after):
            env = dict(os.environ, PYTHONPATH=tree)
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, tree, args.workload, args.configs, str(args.blocks)],
                env=env,
                cwd="/",
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            results[tree].append(got)
            print(f"run {run + 1} {tree}: {json.dumps(got)}", flush=True)
    for tree, runs in results.items():
        for arm in runs[0]:
            steps = statistics.median(r[arm][0] for r in runs)
            owns = [r[arm][1] for r in runs if r[arm][1] is not None]
            own = f"{statistics.median(owns):.2f}" if owns else "-"
            means = [r[arm][2] for r in runs if len(r[arm]) > 2]
            mean = f"  mean {statistics.median(means):8.2f} ms" if means else ""
            print(f"{tree}  {arm:26s} step {steps:8.2f} ms  own {own} ms{mean}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
