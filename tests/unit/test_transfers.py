"""Host transfers and work on skipped steps: one device-to-host copy per collected step, none otherwise,
and no statistics computed on steps that are not collected. Plus a smoke run of the overhead benchmark."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

import numpy as np
import pytest
import torch
from torch import nn

from trainermon import TrainerMon
from trainermon.stats import EngineOptions, StatsEngine, finalize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _WithNone(nn.Module):
    """Returns (tensor, None), as attention blocks often do: the None gets a row made on the host, which
    must reach the device table without a blocking copy."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x * 2, None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.pair = _WithNone()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.pair(self.act(self.fc1(x)))
        return self.fc2(h)


def _monitor(
    tmp_path, monkeypatch, device: str = "cpu", **extra
) -> tuple[TrainerMon, nn.Module, torch.optim.Optimizer]:
    config = {
        "targets": {},
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["norm", "min", "max", "mean", "nans"],
        "format": "csv",
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = _Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    return monitor, model, optimizer


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: str = "cpu", clip: bool = False
) -> None:
    optimizer.zero_grad(set_to_none=True)
    x = torch.randn(5, 8, device=device)
    model(x).square().mean().backward()
    if clip:  # the gradients are read here, before the clipping scales them (`clip_watch`)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    optimizer.step()


def test_one_transfer_per_collected_step_and_none_otherwise(tmp_path, monkeypatch):
    # steps 0, 2, 4 are collected (start_step 0, step_interval 2, collect_times 3); 1, 3, 5, 6 are not
    monitor, model, optimizer = _monitor(tmp_path, monkeypatch, step_interval=2, collect_times=3)
    try:
        expected = {0: True, 1: False, 2: True, 3: False, 4: True, 5: False, 6: False}
        for step, collected in expected.items():
            assert monitor.loop.plan.collecting is collected, step
            transfers, calls = monitor.loop.transfers.count, monitor.loop.engine.calls
            _step(model, optimizer)
            if collected:
                assert monitor.loop.transfers.count == transfers + 1, step
                # every family on: grad_unreduced, grad_reduced, param x2, exp_avg x2, and the hooks'
                # actv and actv_grad tensors (from step 2 on, batched into one call: test_hook_batches)
                assert monitor.loop.engine.calls - calls >= (6 if step else 8), step
            else:
                assert monitor.loop.transfers.count == transfers, step
                assert monitor.loop.engine.calls == calls, step
        assert monitor.loop.transfers.count == 3
        monitor.flush()
        batch = monitor.last_batch
        assert batch is not None and batch.step == 4
        families = {row.family for row in batch.rows}
        assert {"actv", "actv_grad", "grad_reduced", "exp_avg", "exp_avg_sq", "param_updated"} <= families
    finally:
        monitor.close()


def test_idle_dynamic_monitor_never_computes_or_transfers(tmp_path, dynamic_mode, monkeypatch):
    monitor, model, optimizer = _monitor(tmp_path, monkeypatch, dynamic_on=False)
    try:
        for _ in range(3):
            _step(model, optimizer)
        assert monitor.loop.transfers.count == 0
        assert monitor.loop.engine.calls == 0
        assert monitor.loop.plan.collecting is False
    finally:
        monitor.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA device on this machine")
@pytest.mark.parametrize("clip", [False, True], ids=["no-clipping", "clip_grad_norm_"])
def test_monitored_step_never_syncs_outside_the_transfer_point(tmp_path, monkeypatch, clip):
    import trainermon.collect.collector as collector

    monitor, model, optimizer = _monitor(tmp_path, monkeypatch, device="cuda")
    # The single transfer point may wait (it is where the copy is issued); everything else must not.
    original = collector.transfer_to_host

    def allowed(partials: torch.Tensor, counter):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(partials, counter)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(collector, "transfer_to_host", allowed)
    try:
        _step(model, optimizer, "cuda", clip)  # warm-up outside the check (lazy init, allocator)
        before = monitor.loop.transfers.count
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(model, optimizer, "cuda", clip)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert monitor.loop.transfers.count == before + 1
        assert monitor.faults.total == 0
    finally:
        monitor.close()


def test_accelerator_path_reads_nothing_back_on_the_training_thread(tmp_path, monkeypatch):
    """CPU stand-in for the CUDA test above (no GPU here): with the engine on its accelerator path
    (masked, no native kernel), a monitored step with every family on never calls a host read-back
    (`item`, `tolist`, `numpy`, `bool`/`float`/`int` of a tensor) from monitor code on the training thread,
    except inside the single transfer point. Device-only branches (pinned copies, events) are not
    exercised here."""
    import dataclasses
    import threading

    import trainermon.collect.collector as collector

    monitor, model, optimizer = _monitor(tmp_path, monkeypatch)
    monitor.loop.engine.options = dataclasses.replace(
        monitor.loop.engine.options, force_masked=True, fused=False
    )
    ours = tuple(os.path.join(REPO, d) + os.sep for d in ("trainermon", "adapters", "exporters"))
    main = threading.main_thread()
    state = {"in_transfer": False}
    reads: list[str] = []

    def guard(name: str):
        real = getattr(torch.Tensor, name)

        def checked(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if threading.current_thread() is main and caller.startswith(ours) and not state["in_transfer"]:
                reads.append(f"{name} from {os.path.relpath(caller, REPO)}:{sys._getframe(1).f_lineno}")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, checked)

    real_transfer = collector.transfer_to_host

    def transfer(partials, counter):
        state["in_transfer"] = True
        try:
            return real_transfer(partials, counter)
        finally:
            state["in_transfer"] = False

    try:
        _step(model, optimizer)  # warm-up: optimizer state exists from here on
        monitor.flush()
        monkeypatch.setattr(collector, "transfer_to_host", transfer)
        for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__"):
            guard(name)
        nan_model_input = torch.randn(5, 8)
        nan_model_input[0, 0] = float("nan")  # non-finite values must not trigger a read-back either
        optimizer.zero_grad(set_to_none=True)
        model(nan_model_input).square().mean().backward()
        optimizer.step()
        monkeypatch.undo()
        assert reads == []
        assert monitor.loop.transfers.count == 2 and monitor.faults.total == 0
        monitor.flush()
        rows = {(r.family, r.name) for r in monitor.last_batch.rows}
        assert {"actv", "actv_grad", "grad_reduced", "exp_avg", "param_updated"} <= {f for f, _ in rows}
    finally:
        monitor.close()


def test_grouped_small_tensors_match_per_tensor_reference():
    """The engine stacks small same-size tensors; rows must still land in the caller's order."""
    torch.manual_seed(0)
    tensors = [torch.randn(300), torch.randn(16), torch.randn(40, 50), torch.randn(16) * 5, torch.empty(0)]
    tensors += [torch.randn(16).bfloat16(), torch.randn(4, 4).t(), torch.randn(200_000)]
    tensors[3][2] = float("nan")
    for options in (EngineOptions(), EngineOptions(force_masked=True), EngineOptions(zeros_eps=0.5)):
        partials = StatsEngine(options).compute(tensors).numpy()
        values = finalize(partials, np.array([t.numel() for t in tensors], dtype=np.float64))
        for i, t in enumerate(tensors):
            if t.numel() == 0:
                assert values["norm"][i] == 0 and math.isnan(values["mean"][i])
                continue
            ref = t.double().flatten()
            finite = ref[torch.isfinite(ref)]
            assert values["nans"][i] == int(torch.isnan(ref).sum()), (options, i)
            assert values["norm"][i] == pytest.approx(float(finite.norm()), rel=1e-5), (options, i)
            assert values["mean"][i] == pytest.approx(float(finite.mean()), rel=1e-4, abs=1e-6), (options, i)
            assert values["min"][i] == pytest.approx(float(finite.min()), rel=1e-6), (options, i)
            assert values["max"][i] == pytest.approx(float(finite.max()), rel=1e-6), (options, i)
            if options.zeros_eps is not None:
                want = float((finite.abs() < 0.5).sum()) / t.numel()
                assert values["zeros"][i] == pytest.approx(want), (options, i)


def test_overhead_benchmark_smoke():
    sys.path.insert(0, REPO)
    from benchmarks.overhead import Plan, many_workload, run_benchmark

    plan = Plan(blocks={"b": 1}, steps={"b": 1}, warmup=1, engine_reps=2, rss_steps={})
    work = many_workload(d=16, layers=4, tokens=8)
    results = run_benchmark(
        workloads={"b": work}, configs=["idle", "wg"], plan=plan, rss=False, log=lambda _: None
    )
    arms = {row["arm"]: row for row in results["workloads"]["b"]["arms"]}
    assert {"none", "trainermon[idle]", "trainermon[wg]"} <= set(arms)
    assert ("msprobe[wg]" in arms) == results["msprobe_available"]
    for row in arms.values():
        assert row["steps"] == 1
        assert math.isfinite(row["median_step_ms"]) and row["median_step_ms"] > 0
    assert arms["none"]["added_ms"] == 0.0
    assert arms["trainermon[wg]"]["own_ms"] > 0
    assert arms["trainermon[wg]"]["transfers"] == 2  # warm-up step + one timed step, both collected
    assert arms["trainermon[idle]"]["transfers"] == 0
    engine = results["engine"]["b"]
    assert engine["tensors"] == 4 * 4 + 2 and engine["engine_ms"] > 0 and engine["floor_ms"] > 0
    assert any(t["target"].startswith("wg on (b)") for t in results["targets"])
    idle = results["workloads"]["b"]["idle_added_us"]
    assert 0 < idle["optimizer_step_us"] and 0 < idle["with_idle_monitor_us"]
    assert idle["added_us"] == idle["with_idle_monitor_us"] - idle["optimizer_step_us"]
    for t in results["targets"]:
        if "interval_pct" in t:
            low, high = t["interval_pct"]
            assert low <= t["measured_pct"] <= high or t["verdict"] == "within noise"
            assert t["verdict"] in {"met", "missed", "within noise"}


def test_overhead_noise_band():
    """The benchmark's 90% band of the step overhead: around 0 for the same distribution, around the true
    shift otherwise."""
    import random

    sys.path.insert(0, REPO)
    from benchmarks.overhead import overhead_interval

    rng = random.Random(0)
    base = [1.0 + rng.gauss(0, 0.02) for _ in range(50)]
    same = [1.0 + rng.gauss(0, 0.02) for _ in range(50)]
    slower = [1.1 * (1.0 + rng.gauss(0, 0.02)) for _ in range(50)]
    low, high = overhead_interval(same, base, 5, random.Random(1))
    assert low < 0 < high and high - low < 3
    low, high = overhead_interval(slower, base, 5, random.Random(1))
    assert 7 < low < 10 < high < 13
    assert all(math.isnan(v) for v in overhead_interval([], base, 5, random.Random(1)))


def test_overhead_benchmark_rss_probes():
    """The peak-RSS probes: one fresh process per arm and hash seed, medians over seeds, and the anonymous
    peak (VmHWM less the resident file pages) below VmHWM. One arm (each probe is a fresh process, ~11 s
    on a 2-core host, most of it importing torch)."""
    sys.path.insert(0, REPO)
    from benchmarks.overhead import measure_rss

    peaks = measure_rss("b", [("trainermon", "wg")], steps=1, quick=True, seeds=2)
    assert set(peaks) == {"trainermon[wg]"}
    for arm in peaks.values():
        assert len(arm["probes"]) == 2
        for probe in arm["probes"]:
            assert 0 < probe["peak_anon_mb"] < probe["peak_rss_mb"]
        for key in ("peak_rss_mb", "peak_anon_mb"):
            assert arm[key] == statistics.median(p[key] for p in arm["probes"])
