"""Microbenchmarks beside the training steps: the statistics engine against the one-pass floor, and what an
idle monitor adds to one optimizer step."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.arms import _env, write_config
from benchmarks.workloads import Workload


def engine_microbench(work: Workload, reps: int) -> dict[str, Any]:
    """StatsEngine.compute over every gradient vs one fused pass over the same bytes (_foreach_norm).

    The engine is timed as shipped (the native kernel when built) and with the kernel off (eager torch,
    the path accelerators and kernel-less installs take), interleaved with the floor."""
    from trainermon.stats import EngineOptions, StatsEngine, fused

    torch.manual_seed(0)
    model = work.build()
    x, y = work.batch()
    work.loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    engine = StatsEngine(EngineOptions(nonfinite=False))  # ops norm/min/max/mean
    eager = StatsEngine(EngineOptions(nonfinite=False, fused=False))
    engine.compute(grads)
    eager.compute(grads)
    torch._foreach_norm(grads)
    eng_t, eager_t, floor_t = [], [], []
    for _ in range(reps):  # interleaved, so that noise hits all three alike
        for fn, times in (
            (lambda: engine.compute(grads), eng_t),
            (lambda: eager.compute(grads), eager_t),
            (lambda: torch._foreach_norm(grads), floor_t),
        ):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    ratios = [e / f for e, f in zip(eng_t, floor_t)]
    floor_ms = statistics.median(floor_t) * 1e3
    return {
        "tensors": len(grads),
        "elements": sum(g.numel() for g in grads),
        "kernel": fused.KIND,
        "engine_ms": statistics.median(eng_t) * 1e3,
        "eager_ms": statistics.median(eager_t) * 1e3,
        "floor_ms": floor_ms,
        "ratio_of_medians": statistics.median(eng_t) * 1e3 / floor_ms,
        "eager_ratio": statistics.median(eager_t) * 1e3 / floor_ms,
        "median_pair_ratio": statistics.median(ratios),
    }


def idle_microbench(work: Workload, blocks: int, steps: int = 500) -> dict[str, float]:
    """What an idle monitor adds to one optimizer step, hook dispatch included: `optimizer.step()` of the
    workload's model (SGD with no gradients, so the step only walks the parameters: short and steady)
    with and without an idle trainermon attached, interleaved in blocks. An idle monitor does nothing
    else per step, and this resolves microseconds, which a training-step comparison cannot."""
    from trainermon import TrainerMon

    def optimizer(attach: bool, out_dir: str) -> torch.optim.Optimizer:
        torch.manual_seed(0)
        model = work.build()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if attach:
            path = write_config(out_dir, "trainermon", "idle")
            with _env("DYNAMIC_MONITOR", "true"), _env("MONITOR_OUTPUT_DIR", out_dir):
                monitors.append(TrainerMon(path))
                monitors[-1].set_monitor(model, optimizer=opt)
        return opt

    monitors: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="tm-idle-") as out_dir:
        arms = {"none": optimizer(False, out_dir), "idle": optimizer(True, out_dir)}
        times: dict[str, list[float]] = {name: [] for name in arms}
        rng = random.Random(0)
        names = list(arms)
        try:
            for _ in range(blocks):
                rng.shuffle(names)
                for name in names:
                    opt, out = arms[name], times[name]
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        opt.step()
                        out.append(time.perf_counter() - t0)
        finally:
            for monitor in monitors:
                monitor.close()
    none_us, idle_us = (statistics.median(times[n]) * 1e6 for n in ("none", "idle"))
    return {"optimizer_step_us": none_us, "with_idle_monitor_us": idle_us, "added_us": idle_us - none_us}
