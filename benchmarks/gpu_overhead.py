"""The GPU part of the overhead benchmark: a CUDA workload sized for an H100, with no monitor vs trainermon.

    python benchmarks/gpu_overhead.py                       # CUDA, the workload of record (~60 GiB)
    python benchmarks/gpu_overhead.py --device cpu --quick  # smoke run of the script itself (any machine)

What it measures, in one process, for the issue's GPU targets (wg <= 0.5%, all <= 5%, engine <= 1.5x the
floor, no host sync on the training thread outside the single transfer):
- step time of four arms (no monitor, trainermon `wg`, `wg+mv+param` and `all`), each with its own copy of the
  model (same seed), its own AdamW and a fixed batch; arms run in interleaved blocks in a fresh random order
  per block, each step ends with a device synchronize, figures are medians, with the range of the per-block
  differences (arm median / no-monitor median, block by block) as the noise band;
- the engine (`StatsEngine.compute` over every gradient) against the floor `torch._foreach_norm` over the
  same tensors, and the floor's effective bandwidth (bytes read / time), with the kernel's geometry and a
  hook-sized call's host time (`gpu_engine.py`);
- host syncs: one collected step of the `all` arm under `torch.cuda.set_sync_debug_mode("warn")`, counting
  the synchronising calls reported on the training thread (the monitor's one transfer is a non-blocking copy
  into pinned memory, which is not one);
- accuracy: the engine's partials of the gradients on the GPU against a float64 reference on the CPU.
Results: a table on stdout and JSON (`--json`). `benchmarks/gpu.sh` runs this with the CUDA tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from gpu_engine import accuracy, engine_vs_floor, sync  # noqa: E402
from overhead import CONFIGS, OPS  # noqa: E402  (one definition of the configs for CPU and GPU)

ARMS = ("none", "wg", "wg+mv+param", "all")
# Experiments, not monitors (pick with --arms): the floor's read of every gradient in the step, once on the
# training stream after backward, once per parameter on a side stream while backward runs (can overlap hide
# the read that a `wg` row costs?).
EXPERIMENTS = ("read", "read-overlap", "all-hold2")
#: `all-hold2`: `all` with the collector holding at most 2 MiB of hook tensors on the GPU for one batched
#: engine call, the CPU's cache-sized hold and the GPU's before session 23 (256 MiB since): a GPU's
#: activations are larger than that, so each hook costs an engine call of its own, ~150 us of host time.
HOLD_MIB = {"all-hold2": 2}
# The workload of record: a GPT of 8 layers of d=4096 (1.68e9 parameters with vocab 8192), bf16.
FULL = {"d": 4096, "layers": 8, "heads": 32, "vocab": 8192, "seq": 1024, "batch": 4, "blocks": 10, "steps": 3}
# A model whose step is short enough on an H100 for the hooks' host time to show (1.18e8 parameters).
SMALL = {"d": 1024, "layers": 8, "heads": 16, "vocab": 8192, "seq": 512, "batch": 4, "blocks": 10, "steps": 5}
QUICK = {"d": 64, "layers": 2, "heads": 4, "vocab": 128, "seq": 32, "batch": 2, "blocks": 3, "steps": 2}


def build_arm(arm: str, size: dict[str, int], device: torch.device, dtype: torch.dtype, out: str) -> dict:
    from trainermon import TrainerMon
    from trainermon.demo import TinyGPT

    torch.manual_seed(0)
    with device:  # initialised where it trains: a CPU init of 1.7e9 parameters takes longer than the runs
        model = TinyGPT(
            vocab=size["vocab"], d=size["d"], layers=size["layers"], heads=size["heads"], seq=size["seq"]
        )
    model = model.to(dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g).to(device)
    state = {
        "arm": arm,
        "model": model,
        "optimizer": optimizer,
        "batch": tokens,
        "times": [],
        "monitor": None,
        "before_step": None,
    }
    if arm in ("read", "read-overlap"):
        state["before_step"] = read_grads(model, overlap=arm == "read-overlap")
    elif arm != "none":
        path = os.path.join(out, f"{arm}.json")
        config = CONFIGS["all" if arm in HOLD_MIB else arm]
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"targets": {}, "ops": OPS, "format": "csv", **config}, fh)
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, arm)
        state["monitor"] = TrainerMon(path)
        state["monitor"].set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        if arm in HOLD_MIB:
            state["monitor"].loop.collector.hold_bytes_accelerator = HOLD_MIB[arm] << 20
    return state


def step(state: dict, device: torch.device) -> float:
    tokens = state["batch"]
    t0 = time.perf_counter()
    state["optimizer"].zero_grad(set_to_none=True)
    logits = state["model"](tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    if state["before_step"] is not None:
        state["before_step"]()
    state["optimizer"].step()
    sync(device)
    return time.perf_counter() - t0


def read_grads(model: nn.Module, overlap: bool) -> Any:
    """The `read` experiments: `torch._foreach_norm` over every gradient, either after backward on the
    training stream (returned callable) or, with `overlap`, per parameter on a side stream as each gradient
    is accumulated (the callable then makes the training stream wait for the side stream)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not overlap:
        return lambda: torch._foreach_norm([p.grad for p in params])
    side = torch.cuda.Stream()

    def hook(p: torch.Tensor) -> None:
        side.wait_stream(torch.cuda.current_stream())
        p.grad.record_stream(side)  # zero_grad frees it while the side stream may still read it
        with torch.cuda.stream(side):
            torch._foreach_norm([p.grad])

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return lambda: torch.cuda.current_stream().wait_stream(side)


def overhead(arms: dict[str, dict], size: dict[str, int], device: torch.device) -> dict[str, Any]:
    for state in arms.values():  # warm-up: allocator, cuBLAS handles, the monitor's first step
        step(state, device)
    per_block: dict[str, list[float]] = {a: [] for a in arms}
    rng = random.Random(0)
    for _ in range(size["blocks"]):
        order = list(arms)
        rng.shuffle(order)
        for a in order:
            times = [step(arms[a], device) for _ in range(size["steps"])]
            arms[a]["times"].extend(times)
            per_block[a].append(statistics.median(times))
    base = statistics.median(arms["none"]["times"])
    result: dict[str, Any] = {"none_ms": base * 1e3}
    for a in arms:
        if a == "none":
            continue
        diffs = [100.0 * (m / n - 1.0) for m, n in zip(per_block[a], per_block["none"])]
        result[a] = {
            "step_ms": statistics.median(arms[a]["times"]) * 1e3,
            "overhead_pct": 100.0 * (statistics.median(arms[a]["times"]) / base - 1.0),
            "block_range_pct": [min(diffs), max(diffs)],
        }
    return result


def step_peak(arms: dict[str, dict], device: torch.device) -> dict[str, float]:
    """Per arm, the most GPU memory a step allocates above what was allocated before it (MiB, the larger
    of two steps): the arms share one process, so their peaks are measured from each step's own start.
    The difference between arms is what the monitor holds during a step (the hook batches)."""
    peaks = {}
    for name, state in arms.items():
        worst = 0
        for _ in range(2):
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            step(state, device)
            worst = max(worst, torch.cuda.max_memory_allocated(device) - before)
        peaks[name] = worst / 2**20
    return peaks


def host_syncs(state: dict, device: torch.device) -> dict[str, Any] | None:
    """Synchronising calls reported during one collected step (CUDA only), the final synchronize excluded,
    with where each came from (the innermost frames of the Python stack at the warning)."""
    if device.type != "cuda":
        return None
    sites: list[str] = []
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and "prototype" not in str(message):  # not the mode's own notice
            stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
            sites.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in stack[-6:][::-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tokens = state["batch"]
            state["optimizer"].zero_grad(set_to_none=True)
            logits = state["model"](tokens[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            state["optimizer"].step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    sync(device)
    return {"count": len(sites), "sites": sorted(set(sites))}


def profile(arms: dict[str, dict], device: torch.device, path: str) -> str:
    """One step of each arm under torch.profiler: the top operators by self CPU and device time, to see
    where an overhead goes without another run."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with open(path, "w", encoding="utf-8") as fh:
        for name, state in arms.items():
            with torch_profile(activities=activities) as prof:
                step(state, device)
            events = prof.key_averages()
            fh.write(
                f"=== {name}: by self CPU time\n{events.table(sort_by='self_cpu_time_total', row_limit=25)}\n"
            )
            if device.type == "cuda":
                table = events.table(sort_by="self_device_time_total", row_limit=25)
                fh.write(f"=== {name}: by device time\n{table}\n")
    return path


def pyprofile(arms: dict[str, dict], device: torch.device, path: str) -> str:
    """Five steps of each monitored arm under cProfile: the Python functions with the most own time, to
    see where a host-bound step's monitor time goes (the profiler's own cost inflates every figure)."""
    import cProfile
    import io
    import pstats

    with open(path, "w", encoding="utf-8") as fh:
        for name, state in arms.items():
            if state["monitor"] is None:
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step(state, device)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
            fh.write(f"=== {name}: 5 steps\n{text.getvalue()}\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model: checks the script, measures nothing"
    )
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--profile", help="write a profiler table of one step per arm here")
    parser.add_argument(
        "--size", choices=("full", "small"), default="full", help="the workload (default full)"
    )
    parser.add_argument(
        "--overhead-only", action="store_true", help="step overhead only: no engine, accuracy or sync checks"
    )
    parser.add_argument(
        "--pyprofile", help="write cProfile's top functions (own time) over 5 steps of each monitored arm"
    )
    parser.add_argument("--blocks", type=int, help="interleaved blocks (default: the workload's)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, 'none' first (default: all)")
    args = parser.parse_args(argv)
    logging.getLogger("trainermon").setLevel(logging.ERROR)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured (use --device cpu --quick to check the script)")
        return 2
    size = dict(QUICK if args.quick else SMALL if args.size == "small" else FULL)
    if args.blocks:
        size["blocks"] = args.blocks
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = tempfile.mkdtemp(prefix="trainermon-gpu-")
    names = args.arms.split(",")
    if names[0] != "none" or any(a not in ARMS + EXPERIMENTS for a in names):
        parser.error(f"--arms {args.arms!r}: 'none' first, then any of {ARMS[1:] + EXPERIMENTS}")
    arms = {a: build_arm(a, size, device, dtype, out) for a in names}
    params = sum(p.numel() for p in arms["none"]["model"].parameters())
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "workload": {**size, "parameters": params, "dtype": str(dtype)},
        "overhead": overhead(arms, size, device),
    }
    if device.type == "cuda":
        result["step_peak_mib"] = step_peak(arms, device)
    if not args.overhead_only:
        grads = [p.grad for p in arms["none"]["model"].parameters() if p.grad is not None]
        result["engine"] = engine_vs_floor(grads, device, reps=20 if not args.quick else 3)
        result["accuracy"] = accuracy(grads)
        if "all" in arms:
            result["host_syncs_all_step"] = host_syncs(arms["all"], device)
        result["host_syncs_none_step"] = host_syncs(arms["none"], device)  # the training step's own
    if args.profile:
        result["profile"] = profile(arms, device, args.profile)
    if args.pyprofile:
        result["pyprofile"] = pyprofile(arms, device, args.pyprofile)
    for state in arms.values():
        if state["monitor"] is not None:
            state["monitor"].close()
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
