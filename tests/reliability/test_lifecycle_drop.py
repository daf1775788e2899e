"""A monitor dropped without close() (a sweep's helper, an exception mid-run) is freed with its model.

Nothing process-wide may hold the step loop strongly: torch's global optimizer hooks, the scaler and
clipping watches, the worker thread, and a parameter's post-accumulate-grad hooks (which torch also keeps
in C++, where the garbage collector cannot see them). Once the model and optimizer are garbage, the
monitor writes what it collected, closes its sinks and stops its worker."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime import clip_watch, lifecycle, scaler_watch


def _workers() -> int:
    return sum(t.name == "trainermon-worker" for t in threading.enumerate())


def _run(cfg: str, steps: int, clip: bool) -> tuple[weakref.ref, weakref.ref, str, dict]:
    """Train a fresh model `steps` Adam steps under a monitor never closed; return weak references to the
    model and optimizer, the run directory, and the reference gradient norms by (name, step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    ref = {}
    for step in range(steps):
        model(torch.randn(3, 8)).square().sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # scales by 1: the norms stay
        for name, p in model.named_parameters():
            ref[(name, step)] = float(p.grad.double().norm())
        opt.step()
        opt.zero_grad()
    return weakref.ref(model), weakref.ref(opt), monitor.run_dir, ref


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipping"])
def test_dropped_monitor_is_freed_and_flushed(tmp_path, monkeypatch, clip):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], write_interval_s=60)
    pre, post = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    before = (_workers(), len(pre), len(post), len(scaler_watch._LISTENERS), len(clip_watch._listeners))
    runs = [_run(cfg, 3, clip) for _ in range(3)]
    gc.collect()
    for model, opt, _, _ in runs:
        assert model() is None and opt() is None  # the old code kept every dropped run's model alive
    lifecycle.settle()  # the next set_monitor or close removes the dropped runs' hooks (never the collector)
    after = (_workers(), len(pre), len(post), len(scaler_watch._LISTENERS), len(clip_watch._listeners))
    assert after == before  # no worker thread, no global hook or listener left behind
    for _, _, run_dir, ref in runs:
        rows = read_family(run_dir, "grad_reduced")  # written at the drop (the interval is 60 s)
        got = {(r["name"], int(r["step"])): float(r["norm"]) for r in rows}
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key


def test_dropped_monitor_rows_reach_disk_at_exit(tmp_path):
    """A monitor dropped while its model lives goes on collecting; at exit every step is on disk, and the
    exit handler does not need the monitor object (it was dropped) nor keep the model."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "ops": ["norm"], "write_interval_s": 60}))
    script = textwrap.dedent(
        f"""
        import gc, json, torch
        from trainermon import TrainerMon
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon({str(cfg)!r})
        monitor.set_monitor(model, optimizer=opt)
        print(monitor.run_dir)
        del monitor
        gc.collect()
        ref = {{}}
        for step in range(4):
            model(torch.randn(3, 8)).square().sum().backward()
            for name, p in model.named_parameters():
                ref[name + "/" + str(step)] = float(p.grad.double().norm())
            opt.step()
            opt.zero_grad()
        print(json.dumps(ref))
        """
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("DYNAMIC_MONITOR", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    run_dir, ref = done.stdout.strip().splitlines()[:2]
    got = {f"{r['name']}/{r['step']}": float(r["norm"]) for r in read_family(run_dir, "grad_reduced")}
    ref = json.loads(ref)
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


_CC_SWEEP = """
import gc, json, sys, weakref, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
from trainermon import TrainerMon
from trainermon.runtime import lifecycle
names = ("all_reduce", "all_gather", "broadcast", "isend", "irecv", "batch_isend_irecv")
originals = {n: getattr(dist, n) for n in names}

def run(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(sys.argv[1])
    monitor.set_monitor(model, optimizer=opt)
    ref = {}
    for step in range(3):
        model(torch.randn(3, 8)).square().sum().backward()
        t = torch.randn(5)
        ref[step] = float(t.double().norm())  # one rank: the all-reduce's output is its input
        dist.all_reduce(t)
        opt.step()
        opt.zero_grad()
    return weakref.ref(model), weakref.ref(monitor.loop), monitor.run_dir, ref

runs = [run(seed) for seed in range(3)]  # never closed; no collection between runs (a sweep)
gc.collect()
alive = [m() is not None or l() is not None for m, l, _, _ in runs]
lifecycle.settle()  # the next set_monitor or close does this
restored = all(getattr(dist, n) is originals[n] for n in names) and c10d.isend is originals["isend"]
print(json.dumps({"alive": alive, "restored": restored, "runs": [[d, r] for _, _, d, r in runs]}))
dist.destroy_process_group()
"""


def test_dropped_monitor_with_cc_distribution_is_freed_and_unpatched(tmp_path):
    """cc_distribution's wrappers stay in torch.distributed (process-wide) between collected steps: they
    must not keep a dropped monitor alive, and a sweep's runs, patched over one another, must all be
    undone (no wrapper left in the chain, no 'was replaced' warning), each run's comm rows written."""
    import socket

    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "wg_distribution": True,
                "ops": ["norm"],
                "write_interval_s": 60,
                "cc_distribution": {"enable": True},
            }
        )
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("DYNAMIC_MONITOR", None)
    done = subprocess.run(
        [sys.executable, "-c", _CC_SWEEP, str(cfg), str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["alive"] == [False, False, False]  # the old code kept every run's model and loop alive
    assert out["restored"]  # the old code left the last run's wrappers (over the others') installed
    assert "was replaced while cc_distribution watched it" not in done.stderr
    for run_dir, ref in out["runs"]:
        rows = [r for r in read_family(run_dir, "comm") if r["name"].startswith("all_reduce/world/output@")]
        got = {int(r["step"]): float(r["norm"]) for r in rows}
        assert got == pytest.approx(
            {int(k): v for k, v in ref.items()}, rel=1e-5
        )  # one row per step, own run
