"""Engine microbenchmark: `StatsEngine.compute` over every gradient of the overhead benchmark's workloads,
against the one-pass floor (`torch._foreach_norm` over the same tensors), optionally side by side with
another checkout of trainermon (before/after a change).

    python benchmarks/engine.py                         # this checkout only
    python benchmarks/engine.py --compare /tmp/old      # this checkout and /tmp/old, side by side

Method. Each block runs one fresh subprocess per checkout (in a random order), so that each checkout's own
package and native kernel are imported; within a subprocess the engine (kernel as built), the engine with
the kernel off (eager path) and the floor are timed interleaved, `reps` times each, after a warm-up. A
block's figure is the median ratio engine / floor, which cancels most machine noise; the result is the
median over blocks with the range of the block medians as the noise band. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
# trainermon first, from the checkout (PYTHONPATH): overhead.py puts its own repository first on sys.path,
# so importing it first would time that repository's engine for every checkout
try:
    from trainermon.stats import EngineOptions, StatsEngine, fused
except ImportError:  # a checkout from before the stats package
    from trainermon import fused
    from trainermon.stats import EngineOptions, StatsEngine
import os
if not os.path.realpath(fused.__file__).startswith(os.path.realpath({checkout!r}) + os.sep):
    raise SystemExit(f"timed the wrong checkout: {{fused.__file__}}")
sys.path.insert(0, {bench!r})
from overhead import gpt_workload, many_workload
out = {{}}
for key, work in (("a", gpt_workload()), ("b", many_workload())):
    torch.manual_seed(0)
    model = work.build()
    x, y = work.batch()
    work.loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    engine = StatsEngine(EngineOptions(nonfinite=False))
    eager = StatsEngine(EngineOptions(nonfinite=False, fused=False))
    arms = {{"engine": lambda: engine.compute(grads), "eager": lambda: eager.compute(grads),
             "floor": lambda: torch._foreach_norm(grads)}}
    for fn in arms.values():
        fn()
    times = {{k: [] for k in arms}}
    for _ in range({reps}):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {{k: statistics.median(v) * 1e3 for k, v in times.items()}}
    ratios = [e / f for e, f in zip(times["engine"], times["floor"])]
    eager_ratios = [e / f for e, f in zip(times["eager"], times["floor"])]
    out[key] = {{"tensors": len(grads), "elements": sum(g.numel() for g in grads), "kernel": fused.KIND,
                "engine_ms": med["engine"], "eager_ms": med["eager"], "floor_ms": med["floor"],
                "ratio": statistics.median(ratios), "eager_ratio": statistics.median(eager_ratios)}}
print(json.dumps(out))
"""


def run_child(checkout: str, reps: int) -> dict:
    code = _CHILD.format(bench=os.path.join(REPO, "benchmarks"), reps=reps, checkout=checkout)
    env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child for {checkout} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", help="another checkout (built in place) to time side by side")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    checkouts = {"this": REPO}
    if args.compare:
        checkouts["compare"] = os.path.abspath(args.compare)
    blocks: dict[str, list[dict]] = {name: [] for name in checkouts}
    rng = random.Random(0)
    for b in range(args.blocks):
        order = list(checkouts)
        rng.shuffle(order)
        for name in order:
            blocks[name].append(run_child(checkouts[name], args.reps))
        print(f"block {b + 1}/{args.blocks} done", file=sys.stderr)
    summary: dict[str, dict] = {}
    for name, runs in blocks.items():
        summary[name] = {"checkout": checkouts[name]}
        for key in ("a", "b"):
            first = runs[0][key]
            entry = {"tensors": first["tensors"], "elements": first["elements"], "kernel": first["kernel"]}
            for field in ("ratio", "eager_ratio", "engine_ms", "eager_ms", "floor_ms"):
                values = [r[key][field] for r in runs]
                entry[field] = statistics.median(values)
                entry[field + "_band"] = [min(values), max(values)]
            summary[name][key] = entry
    for name, res in summary.items():
        for key in ("a", "b"):
            e = res[key]
            print(
                f"{name:8s} ({key}) {e['tensors']:4d} tensors {e['elements'] / 1e6:6.2f}M: engine "
                f"{e['engine_ms']:7.2f} ms = {e['ratio']:.2f}x floor (band {e['ratio_band'][0]:.2f}.."
                f"{e['ratio_band'][1]:.2f}; kernel {e['kernel']}), eager {e['eager_ratio']:.2f}x "
                f"(band {e['eager_ratio_band'][0]:.2f}..{e['eager_ratio_band'][1]:.2f}), "
                f"floor {e['floor_ms']:.2f} ms"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"blocks": args.blocks, "reps": args.reps, "results": summary}, fh, indent=2)


if __name__ == "__main__":
    main()
