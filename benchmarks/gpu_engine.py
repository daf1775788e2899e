"""The engine part of the GPU benchmark (`gpu_overhead.py` calls it): the engine over every gradient against
`torch._foreach_norm`, the Triton kernel's geometry, a hook-sized call's host time by part, and the
engine's accuracy on the GPU against float64 on the CPU."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def engine_vs_floor(grads: list[torch.Tensor], device: torch.device, reps: int) -> dict[str, Any]:
    """The engine over every gradient (its default path: the Triton kernel where it runs; and the eager
    multi-kernel path) against `torch._foreach_norm`, timed alternately; plus a sweep of the kernel's block
    and chunk sizes, and the host time of one call on a small batch (what a hook pays to launch)."""
    from trainermon.stats import EngineOptions, StatsEngine, triton_stats

    default = StatsEngine(EngineOptions(nonfinite=True))
    eager = StatsEngine(EngineOptions(nonfinite=True, fused=False))
    arms = {
        "engine": lambda: default.compute(grads),
        "eager": lambda: eager.compute(grads),
        "floor": lambda: torch._foreach_norm(grads),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(reps):
        for a, fn in arms.items():
            times[a].append(_median_ms(fn, device, 1))
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    med = {a: statistics.median(v) for a, v in times.items()}
    result: dict[str, Any] = {
        "tensors": len(grads),
        "bytes": nbytes,
        "triton": triton_stats.enabled(),
        "engine_ms": med["engine"],
        "eager_ms": med["eager"],
        "floor_ms": med["floor"],
        "ratio": med["engine"] / med["floor"],
        "eager_ratio": med["eager"] / med["floor"],
        "engine_range_ms": [min(times["engine"]), max(times["engine"])],
        "floor_range_ms": [min(times["floor"]), max(times["floor"])],
        "floor_GBps": nbytes / med["floor"] / 1e6,
        "engine_GBps": nbytes / med["engine"] / 1e6,
    }
    if triton_stats.enabled():
        result["kernel_sweep_ms"] = sweep(lambda: default.compute(grads), device, max(3, reps // 2))
    # A hook's batch: one or two activations, where the kernel must still spread over every multiprocessor.
    for shape, k in (((4, 1024, 4096), 2), ((4, 1024, 16384), 1)):
        acts = [torch.randn(shape, device=device, dtype=grads[0].dtype) for _ in range(k)]
        name = "x".join(map(str, shape)) + f"_x{k}"
        result[f"activations_{name}"] = {
            "engine_ms": _median_ms(lambda acts=acts: default.compute(acts), device, reps),
            "floor_ms": _median_ms(lambda acts=acts: torch._foreach_norm(acts), device, reps),
        }
        if triton_stats.enabled():
            found = sweep(lambda acts=acts: default.compute(acts), device, reps)
            result[f"activations_{name}"]["sweep_ms"] = found
    small = [torch.randn(4, 1024, 512, device=device, dtype=grads[0].dtype) for _ in range(3)]
    for name, engine in (("engine", default), ("eager", eager)):
        engine.compute(small)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(50):
            engine.compute(small)
        result[f"{name}_host_us_per_small_call"] = (time.perf_counter() - t0) / 50 * 1e6
        sync(device)
    if triton_stats.enabled():
        result["small_call"] = small_call(small, default, device)
    return result


def small_call(small: list[torch.Tensor], engine: Any, device: torch.device) -> dict[str, float]:
    """Where a hook-sized engine call's time goes (us per call, 200 calls each): host time of the parts of
    `triton_stats.partials` (the kernel table's trip through pinned memory, the two output buffers, the
    whole call) and of the engine around it; device time per call (CUDA events over the same 200 calls);
    the floor's host and device time on the same tensors."""
    from trainermon.stats import triton_stats as ts

    numels = [t.numel() for t in small]
    layout = [[t.data_ptr() for t in small] + [0], numels + [0], list(range(len(small) + 1))]

    def table() -> None:
        torch.tensor(layout, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)

    def buffers() -> None:
        torch.empty((64, 7), dtype=torch.float64, device=device)
        torch.empty((len(small), 7), dtype=torch.float64, device=device)

    parts = {
        "table": table,
        "buffers": buffers,
        "partials": lambda: ts.partials(small, True, None),
        "engine": lambda: engine.compute(small),
        "engine_general_path": lambda: general_path(engine, small),
        "floor": lambda: torch._foreach_norm(small),
    }
    found: dict[str, float] = {}
    for name, fn in parts.items():
        fn()
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(200):
            fn()
        end.record()
        found[f"{name}_host_us"] = (time.perf_counter() - t0) / 200 * 1e6
        end.synchronize()
        found[f"{name}_device_us"] = start.elapsed_time(end) / 200 * 1e3  # a lower bound when host-bound
    return found


KERNEL_CONFIGS = (  # BLOCK, WARPS, MAX_CHUNK, PROGRAMS_PER_SM
    (512, 4, 1 << 16, 8),
    (1024, 4, 1 << 16, 8),
    (512, 8, 1 << 16, 8),
    (256, 2, 1 << 15, 8),
    (512, 4, 1 << 17, 4),
    (1024, 8, 1 << 17, 16),
)


def general_path(engine: Any, tensors: list[torch.Tensor]) -> None:
    """`engine.compute` without its short path for plain batches (what every call took before it)."""
    from trainermon.stats import engine as module

    short, module._all_triton = module._all_triton, lambda *_: None
    try:
        engine.compute(tensors)
    finally:
        module._all_triton = short


def sweep(fn, device: torch.device, reps: int) -> dict[str, float]:
    """`fn`'s median time under each kernel geometry (the module's settings are restored after)."""
    from trainermon.stats import triton_stats as ts

    saved = (ts.BLOCK, ts.WARPS, ts.MAX_CHUNK, ts.PROGRAMS_PER_SM)
    found = {}
    try:
        for config in KERNEL_CONFIGS:
            ts.BLOCK, ts.WARPS, ts.MAX_CHUNK, ts.PROGRAMS_PER_SM = config
            found["block{}_warps{}_maxchunk{}_per_sm{}".format(*config)] = _median_ms(fn, device, reps)
    finally:
        ts.BLOCK, ts.WARPS, ts.MAX_CHUNK, ts.PROGRAMS_PER_SM = saved
    return found


def accuracy(grads: list[torch.Tensor]) -> dict[str, float]:
    """Largest relative error of the engine's sum of squares and sum (GPU) against float64 on the CPU."""
    from trainermon.stats import SUM, SUMSQ, EngineOptions, StatsEngine

    partials = StatsEngine(EngineOptions(nonfinite=True)).compute(grads).cpu()  # the default path
    worst = {"sumsq_rel": 0.0, "sum_abs_over_l1": 0.0}
    for i, g in enumerate(grads):
        ref = g.detach().double().cpu().flatten()
        sumsq = float((ref * ref).sum())
        if sumsq > 0:
            worst["sumsq_rel"] = max(worst["sumsq_rel"], abs(float(partials[i, SUMSQ]) - sumsq) / sumsq)
        l1 = float(ref.abs().sum())
        if l1 > 0:
            worst["sum_abs_over_l1"] = max(
                worst["sum_abs_over_l1"], abs(float(partials[i, SUM]) - float(ref.sum())) / l1
            )
    return worst
