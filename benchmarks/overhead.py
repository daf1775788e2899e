"""Overhead benchmark: no monitor vs trainermon vs msprobe's TrainerMon, side by side in one process.

    python benchmarks/overhead.py            # full run (a few minutes on 2 CPU cores)
    python benchmarks/overhead.py --quick    # smoke run (< 60 s)

Method. Every arm (no monitor; trainermon and msprobe, each under every config) gets its own copy of the
model (same seed), its own AdamW and its own fixed batch, and its monitor stays attached for the whole run.
After one warm-up block, the arms run in interleaved blocks (a fresh random order per block, `steps` steps
per arm per block), so that machine noise falls on every arm alike; figures are medians over all timed
steps. Peak RSS is measured per arm in a fresh subprocess (one process per arm; a shared process cannot
tell arms apart). The monitor's own time is trainermon's time inside its entry points on the training
thread (optimizer hooks, step begin, and every statistics batch added from forward/backward hooks);
hook dispatch outside those entry points shows up only in the step-time difference.

Configs: idle (attached with DYNAMIC_MONITOR=true and dynamic_on false: nothing is collected), wg (weight
gradients), wg+mv+param, all (activations and activation gradients of every module + wg + mv + param);
ops norm/min/max/mean throughout. Results: a table on stdout and JSON (`--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# pieces of the benchmark, one module each; re-exported here for the scripts that import `overhead`
from benchmarks.arms import (  # noqa: E402,F401
    CONFIGS,
    OPS,
    Arm,
    OwnTimer,
    build_arm,
    close_arm,
    msprobe_available,
    run_step,
    write_config,
)
from benchmarks.microbench import engine_microbench, idle_microbench  # noqa: E402
from benchmarks.overhead_report import _cpu_name, check_targets, format_table  # noqa: E402,F401
from benchmarks.peak_memory import peak_anon_mb, peak_rss_mb  # noqa: E402,F401
from benchmarks.workloads import (  # noqa: E402,F401
    Workload,
    gpt_workload,
    many_workload,
    moe_workload,
    standard_workloads,
)

#: the older name, which checkout_ab.py's child calls in every checkout it compares
_workloads = standard_workloads


def rss_probe(workload: str, tool: str, config: str, steps: int, quick: bool) -> dict[str, float]:
    """Runs in a fresh process: one arm alone, `steps` steps; returns its peak RSS."""
    work = _workloads(quick)[workload]
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as out_dir:
        arm = build_arm(work, tool, config, out_dir)
        for _ in range(steps):
            run_step(arm)
        close_arm(arm)
        return {
            "peak_rss_mb": peak_rss_mb(),
            "peak_anon_mb": peak_anon_mb(),
            "median_step_s": statistics.median(arm.times),
        }


def measure_rss(
    workload: str, arms: list[tuple[str, str]], steps: int, quick: bool, seeds: int = 1
) -> dict[str, dict[str, Any]]:
    """Peak RSS and peak anonymous memory of each arm: one fresh process per arm and hash seed, arms in
    turn within each seed. Per arm: the medians over seeds and every probe's figures.

    Why seeds: a probe's peak sits on one of levels about 4 MB apart (on (c) and (b)), whichever the heap's
    layout gives it, and the layout follows the order and addresses of allocations, which the string hash
    seed (dict and set sizes, iteration order) and address-space randomisation change. With both free the
    same arm landed on either level run to run; with PYTHONHASHSEED pinned and randomisation off
    (`setarch -R`, where it exists), a probe repeats to 0.4 MB (session 20). Every arm runs under the same
    seeds, so each seed compares like with like, and the median over seeds does not hang on one layout."""
    fixed = ["setarch", platform.machine(), "-R"]
    if not shutil.which("setarch") or subprocess.run([*fixed, "true"], capture_output=True).returncode:
        fixed = []  # not there, or not allowed here (a container may refuse the personality call)
    probes: dict[str, list[dict[str, float]]] = {}
    for seed in range(seeds):
        for tool, config in arms:
            cmd = [*fixed, sys.executable, os.path.abspath(__file__)]
            cmd += ["--rss-probe", f"{workload}:{tool}:{config}", "--rss-steps", str(steps)]
            cmd += ["--threads", str(torch.get_num_threads())]
            cmd += ["--quick"] if quick else []
            # glibc's mmap threshold pinned at its initial 128 KiB: by default it grows with every large
            # free, so where freed activations land (heap or returned to the OS) varies by run and peak
            # RSS jittered by +-1% between identical probes; pinned, it tracks live memory (+-0.2%).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONHASHSEED": str(seed)}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            name = "none" if tool == "none" else f"{tool}[{config}]"
            try:
                probe = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                print(f"  rss probe {name} failed: {proc.stderr[-400:]}", file=sys.stderr)
                probe = {}
            probes.setdefault(name, []).append(probe)
    out: dict[str, dict[str, Any]] = {}
    for name, runs in probes.items():
        out[name] = {"probes": runs}
        for key in ("peak_rss_mb", "peak_anon_mb"):
            values = [r.get(key, float("nan")) for r in runs]
            out[name][key] = statistics.median(values) if all(v == v for v in values) else float("nan")
    return out


def bench_workload(
    work: Workload, configs: list[str], tools: list[str], blocks: int, steps: int, warmup: int, seed: int
) -> dict[str, Any]:
    arms: list[Arm] = []
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as out_dir:
        try:
            arms.append(build_arm(work, "none", "-", out_dir))
            for config in configs:
                for tool in tools:
                    arms.append(build_arm(work, tool, config, out_dir))
            for arm in arms:  # warm-up: allocator, optimizer state, msprobe's first-step setup
                for _ in range(warmup):
                    run_step(arm)
                arm.times.clear()
                arm.own.clear()
            rng = random.Random(seed)
            gc.collect()
            for _ in range(blocks):
                order = arms[:]
                rng.shuffle(order)
                for arm in order:
                    for _ in range(steps):
                        run_step(arm)
            monitor_time = {
                a.name: float(getattr(a.monitor, "monitor_time_s", float("nan")))
                for a in arms
                if a.tool == "trainermon"
            }
            transfers = {a.name: a.monitor.loop.transfers.count for a in arms if a.tool == "trainermon"}
        finally:
            for arm in arms:
                close_arm(arm)
    base = statistics.median(arms[0].times)
    mean_base = statistics.fmean(arms[0].times)
    rng = random.Random(seed + 1)
    rows = []
    for arm in arms:
        med = statistics.median(arm.times)
        mean = statistics.fmean(arm.times)
        row = {
            "arm": arm.name,
            "tool": arm.tool,
            "config": arm.config,
            "steps": len(arm.times),
            "median_step_ms": med * 1e3,
            "added_ms": (med - base) * 1e3,
            "overhead_pct": (med / base - 1.0) * 100.0,
            # The worker writes in batches (write_interval_s), so its cost lands on one step in several
            # and a median can miss it; the mean cannot.
            "mean_step_ms": mean * 1e3,
            "mean_overhead_pct": (mean / mean_base - 1.0) * 100.0,
            "overhead_interval_pct": overhead_interval(arm.times, arms[0].times, steps, rng),
            "own_ms": statistics.median(arm.own) * 1e3 if arm.own else None,
            "monitor_time_s_last": monitor_time.get(arm.name),
            "transfers": transfers.get(arm.name),
        }
        rows.append(row)
    by_name = {r["arm"]: r for r in rows}
    for r in rows:
        if r["tool"] == "trainermon":
            ms = by_name.get(f"msprobe[{r['config']}]")
            if ms is not None:
                tm_added, ms_added = max(r["added_ms"], 0.0), max(ms["added_ms"], 0.0)
                r["step_ratio_vs_msprobe"] = r["median_step_ms"] / ms["median_step_ms"]
                r["added_ratio_vs_msprobe"] = tm_added / ms_added if ms_added > 0 else None
    return {"workload": work.key, "title": work.title, "baseline_ms": base * 1e3, "arms": rows}


def overhead_interval(
    times: list[float], base: list[float], block: int, rng: random.Random, reps: int = 2000
) -> tuple[float, float]:
    """90% interval of the median-step overhead (%), by resampling whole blocks of each arm's steps
    (steps of one block run back to back, so they share the machine's state and are not independent).
    This is the noise band: a target inside it cannot be decided by step time on this machine."""

    def resample(values: list[float]) -> list[float]:
        groups = [values[i : i + block] for i in range(0, len(values), block)]
        return [v for _ in groups for v in rng.choice(groups)]

    if not times or not base:
        return (float("nan"), float("nan"))
    ratios = sorted(
        (statistics.median(resample(times)) / statistics.median(resample(base)) - 1.0) * 100.0
        for _ in range(reps)
    )
    return (ratios[int(0.05 * reps)], ratios[int(0.95 * reps) - 1])


@dataclass(frozen=True)
class Plan:
    blocks: dict[str, int]
    steps: dict[str, int]
    warmup: int
    engine_reps: int
    #: steps per peak-RSS probe, by workload (none: no probe). (a) and (b) write the same rows every step,
    #: so two steps show their steady state; (c)'s expert rows change every step, and the monitor's row
    #: cache and texts fill up over several (docs/PERFORMANCE.md, session 18: +2.0% after 2, +2.5% after 12).
    rss_steps: dict[str, int]
    #: hash seeds per peak-RSS probe, by workload (`measure_rss`): more where the monitor's share is small
    rss_seeds: dict[str, int] = field(default_factory=dict)
    idle_blocks: int = 8


#: Block counts. (a) steps take ~3.5 s on one core, so 8 blocks x 1 step per arm (plus one warm-up step)
#: take its 9 arms about 6 minutes (4 blocks left a noise band of +-10 points); (b) steps take ~55 ms:
#: 10 blocks x 5 steps per arm.
FULL = Plan(
    blocks={"a": 8, "b": 10, "c": 10},
    steps={"a": 1, "b": 5, "c": 5},
    warmup=1,
    engine_reps=15,
    rss_steps={"a": 2, "b": 2, "c": 12},
    rss_seeds={"c": 3},  # (a), (b): the monitor's share is within +-0.3% there (run 10), one seed
)
QUICK = Plan(
    blocks={"a": 2, "b": 2}, steps={"a": 2, "b": 3}, warmup=1, engine_reps=5, rss_steps={}, idle_blocks=2
)


def run_benchmark(
    quick: bool = False,
    workloads: dict[str, Workload] | None = None,
    configs: list[str] | None = None,
    plan: Plan | None = None,
    rss: bool = True,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the whole benchmark and return the results (the JSON document)."""
    plan = plan or (QUICK if quick else FULL)
    workloads = workloads or _workloads(quick)
    configs = configs or list(CONFIGS)
    has_msprobe, msprobe_note = msprobe_available()
    tools = ["trainermon"] + (["msprobe"] if has_msprobe else [])
    log(f"msprobe: {msprobe_note}")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "msprobe": msprobe_note,
        "msprobe_available": has_msprobe,
        "plan": {"blocks": plan.blocks, "steps_per_block": plan.steps, "warmup_steps": plan.warmup},
        "quick": quick,
        "workloads": {},
        "engine": {},
    }
    for key, work in workloads.items():
        log(f"[{key}] {work.title}: {len(configs) * len(tools) + 1} arms ...")
        res = bench_workload(
            work, configs, tools, plan.blocks.get(key, 2), plan.steps.get(key, 1), plan.warmup, seed
        )
        results["workloads"][key] = res
        results["engine"][key] = engine_microbench(work, plan.engine_reps)
        idle = idle_microbench(work, plan.idle_blocks)
        res["idle_added_us"] = idle
        res["idle_added_pct"] = idle["added_us"] / (res["baseline_ms"] * 1e3) * 100.0
        log(
            f"idle monitor: +{idle['added_us']:.1f} us per optimizer step (hooks included; "
            f"{res['idle_added_pct']:.4f}% of the training step)"
        )
        if rss and plan.rss_steps.get(key, 0) > 0:
            arms = [("none", "-")] + [(t, c) for c in configs for t in tools]
            peaks = measure_rss(key, arms, plan.rss_steps[key], quick, plan.rss_seeds.get(key, 1))
            base = peaks.get("none", {})
            for row in res["arms"]:
                peak = peaks.get(row["arm"], {})
                row["rss_probes"] = peak.get("probes", [])
                row["peak_rss_mb"] = peak.get("peak_rss_mb", float("nan"))
                row["peak_anon_mb"] = peak.get("peak_anon_mb", float("nan"))
                if base.get("peak_rss_mb") and row["peak_rss_mb"] == row["peak_rss_mb"]:
                    row["peak_rss_pct"] = (row["peak_rss_mb"] / base["peak_rss_mb"] - 1.0) * 100.0
                    # the added anonymous memory in MB: what the monitor holds, whatever the host maps
                    row["peak_anon_added_mb"] = row["peak_anon_mb"] - base.get("peak_anon_mb", float("nan"))
        log(format_table(res, results["engine"][key]))
    results["targets"] = check_targets(results)
    results["wall_s"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller GPT, fewer blocks, no RSS")
    parser.add_argument("--no-rss", action="store_true", help="skip the per-arm peak-RSS subprocesses")
    parser.add_argument(
        "--json",
        help="where to write the results (default: benchmarks/overhead_results.json for a full run, the "
        "run of record quoted in docs/PERFORMANCE.md; a temporary file for --quick)",
    )
    parser.add_argument("--workloads", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine, 2 threads turn every busy "
        "neighbour into OpenMP barrier stalls that swamp the differences being measured)",
    )
    parser.add_argument("--rss-probe", help=argparse.SUPPRESS)
    parser.add_argument("--rss-steps", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.getLogger("trainermon").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    # msprobe's full backward hooks warn on every step of a model whose inputs need no grad
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if args.rss_probe:
        workload, tool, config = args.rss_probe.split(":")
        with contextlib.redirect_stdout(sys.stderr):  # msprobe prints; keep stdout for the result
            result = rss_probe(workload, tool, config, args.rss_steps, args.quick)
        print(json.dumps(result))
        return 0
    chosen = _workloads(args.quick)
    workloads = {k: chosen[k] for k in args.workloads.split(",")}
    if args.json is None:
        args.json = (
            os.path.join(tempfile.gettempdir(), "trainermon_overhead_quick.json")
            if args.quick
            else os.path.join(REPO, "benchmarks", "overhead_results.json")
        )
    results = run_benchmark(quick=args.quick, workloads=workloads, rss=not args.no_rss, seed=args.seed)
    if args.quick:
        print("  (quick mode: smaller models; the targets below are defined for the full run)")
    for t in results["targets"]:
        value = t.get("measured_pct", t.get("measured_ratio"))
        extra = ""
        if "interval_pct" in t:
            low, high = t["interval_pct"]
            extra = (
                f" (mean {t['mean_pct']:.2f}; 90% band {low:.2f} to {high:.2f}: {t['verdict']}; "
                f"own time {t['own_time_pct']:.2f}%)"
            )
        label = {"met": "MET", "missed": "MISS", "within noise": "NOISE"}.get(t.get("verdict", ""))
        label = label or ("MET" if t["met"] else "MISS")
        print(f"  {label:5} {t['target']}: {value:.2f}{extra}")
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=2)
    print(f"results: {args.json} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
