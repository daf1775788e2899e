"""torch.compile with and without the monitor: steady-state step time, graphs, graph breaks, frames compiled,
and the monitor's overhead on the compiled model against its overhead on the same model run eagerly.

    PYTHONPATH=. python benchmarks/bench_compile.py [--backend inductor] [--steps 60] [--rounds 3]
        [--layers 8] [--width 256] [--tp] [--device cuda] [--forward-only | --both [--hold0]]

Arms over the same MLP (`--layers` Linear+GELU layers, default 8 of width 256, batch 64, CPU, one thread;
`--layers 32 --width 64` is a model of many small modules, where per-module costs dominate): compiled
without the monitor; compiled with the monitor's xy_distribution scheduled but no step collected
(start_step beyond the run); compiled with every step collected; and eager without the monitor and with
every step collected. `--device cuda` runs the same arms on the GPU (step times taken after a
synchronize). `--forward-only` collects actv alone in both modes: the like-for-like comparison on a torch
older than 2.12, whose compiled graphs write no actv_grad rows; `--both` adds the forward-only arms to the
same rounds (`compiled/every-fo`, `eager/every-fo`); `--hold0` one more, `compiled/every-fo-hold0`
(`accelerator_hold_mib` 0: on a GPU each tap's tensors reduced before the tap returns). Each round
runs every arm once, in a fresh random order; within an arm, step times are taken after a warm-up third
of the steps (which covers the first collected step's recompile). Printed per arm: the median over
rounds of each round's median step, the spread of those round medians, and dynamo's counters from the
last round. Then the overheads (collected against no monitor, same mode) and their ratio, compiled over
eager (issue 23's target: at most 2).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ARMS = (
    ("compiled", "off"),
    ("compiled", "idle"),
    ("compiled", "every"),
    ("eager", "off"),
    ("eager", "every"),
)
#: `--both`: the forward-only arms too, in the same rounds (one process, one machine): numbers from two
#: sessions differ by more than the monitor's overhead (H200, session 30: the off arms by 20%, and
#: compiled/every's round medians of one run spread 5.8-8.6 ms)
FORWARD_ARMS = (("compiled", "every-fo"), ("eager", "every-fo"))
#: `--hold0`: also the compiled forward-only arm with `accelerator_hold_mib` 0, where each tap's tensors are
#: reduced before the tap returns, as every tap's were before session 32 (now: copied into the hook batch)
HOLD0_ARMS = (("compiled", "every-fo-hold0"),)


def run(
    compiled: bool,
    mode: str,
    backend: str,
    steps: int,
    out: Path,
    layers: int = 8,
    width: int = 256,
    tp: bool = False,
    device: str = "cpu",
    forward_only: bool = False,
) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainermon import TrainerMon

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*modules).to(device)
    if tp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        for pair in range(layers // 2):
            plan[str(4 * pair)] = ColwiseParallel(use_local_output=False)
            plan[str(4 * pair + 2)] = RowwiseParallel()
        parallelize_module(model, init_device_mesh("cpu", (1,)), plan)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = None
    if mode != "off":
        cfg = out / f"{mode}.json"
        fo = forward_only or "-fo" in mode
        keys = {"xy_distribution": True, "ops": ["norm", "min", "max"], "forward_only": fo}
        if mode.endswith("-hold0"):
            keys["accelerator_hold_mib"] = 0  # each tap's tensors reduced before it returns, uncopied
        if mode == "idle":
            keys["start_step"] = 10**9
        cfg.write_text(json.dumps(keys))
        monitor = TrainerMon(str(cfg))
        monitor.set_monitor(model, optimizer=opt)
    forward = torch.compile(model, backend=backend) if compiled else model
    x = torch.randn(64, width, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        forward(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
    if monitor is not None:
        monitor.close()
    return {
        "median_ms": 1e3 * statistics.median(times[steps // 3 :]),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        # frames dynamo compiled, first compiles and recompiles together (it keeps no recompile counter)
        "frames_compiled": counters["frames"]["ok"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tp", action="store_true", help="tensor-parallel pairs (DTensor activations)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (not with --tp)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--forward-only", action="store_true", help="actv only, no actv_grad")
    which.add_argument("--both", action="store_true", help="with and without forward_only, same rounds")
    parser.add_argument("--hold0", action="store_true", help="with --both: a compiled arm holding nothing")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.tp and args.device != "cpu":
        parser.error("--tp builds a one-rank gloo mesh on the CPU; leave --device out")
    torch.set_num_threads(1)
    if args.tp:
        import os

        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    if args.hold0 and not args.both:
        parser.error("--hold0 compares with the forward-only arms: give --both too")
    arms_run = ARMS + (FORWARD_ARMS if args.both else ()) + (HOLD0_ARMS if args.hold0 else ())
    medians: dict[str, list[float]] = {f"{c}/{m}": [] for c, m in arms_run}
    last: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        import os

        os.environ.setdefault("MONITOR_OUTPUT_DIR", tmp)
        for _ in range(args.rounds):
            for compiled, mode in random.sample(arms_run, len(arms_run)):
                result = run(
                    compiled == "compiled",
                    mode,
                    args.backend,
                    args.steps,
                    Path(tmp),
                    args.layers,
                    args.width,
                    args.tp,
                    args.device,
                    args.forward_only,
                )
                medians[f"{compiled}/{mode}"].append(result["median_ms"])
                last[f"{compiled}/{mode}"] = result
    arms = {}
    for name, values in medians.items():
        spread = {"low_ms": min(values), "high_ms": max(values)}
        arms[name] = dict(last[name], median_ms=statistics.median(values), rounds_ms=values, **spread)
        print(json.dumps({"arm": name, **arms[name]}))
    added = {
        c: arms[f"{c}/every"]["median_ms"] - arms[f"{c}/off"]["median_ms"] for c in ("compiled", "eager")
    }
    ratio = added["compiled"] / added["eager"] if added["eager"] > 0 else float("nan")
    summary = {"added_ms_compiled": added["compiled"], "added_ms_eager": added["eager"], "ratio": ratio}
    if args.both:
        for c in ("compiled", "eager"):
            summary[f"added_ms_{c}_fo"] = arms[f"{c}/every-fo"]["median_ms"] - arms[f"{c}/off"]["median_ms"]
    if args.hold0:
        off = arms["compiled/off"]["median_ms"]
        summary["added_ms_compiled_fo_hold0"] = arms["compiled/every-fo-hold0"]["median_ms"] - off
    print(json.dumps(summary))
    if args.json:
        run_of = {"args": vars(args), "torch": torch.__version__}
        if args.device == "cuda":
            run_of["device_name"] = torch.cuda.get_device_name()
        Path(args.json).write_text(json.dumps({**run_of, "arms": arms, **summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
