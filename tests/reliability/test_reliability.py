"""Reliability: generated configs at construction and in a running job, and a clean interpreter exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from trainermon import ConfigError, MonitorConfig, TrainerMon, parse_config
from trainermon.stats.table import OPS as SUPPORTED_OPS

KEYS = [f.name for f in fields(MonitorConfig)] + ["ur_distribution", "append_output", "sa_order"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["../../etc", "/abs/path", "csv", "parquet", "norm", "ünïcødé", "\x00", "1e8"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
plausible = st.one_of(values, st.lists(st.sampled_from(SUPPORTED_OPS + ("id", "median")), max_size=6))
configs = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=10), plausible, max_size=8)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=configs | values)
def test_construction_works_or_raises_one_clear_error(raw):
    try:
        cfg = parse_config(raw)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("config") and ("allowed" in message or "top level" in message)
        return
    assert isinstance(cfg, MonitorConfig)
    assert cfg.step_interval >= 1 and cfg.collect_times >= 0 and set(cfg.ops) <= set(SUPPORTED_OPS)


path_like = st.lists(
    st.sampled_from(["a", "b", ".", "..", "/", "\\", "~", " ", "\x00", "é"]), max_size=12
).map("".join)


@settings(max_examples=1500, deadline=None)
@given(
    path=path_like | st.sampled_from(["..", "/etc", "a/../..", "./.././x", "a/./b/../c"]),
    key=st.sampled_from(["parquet.dir", "prometheus.sd_dir"]),
)
def test_output_paths_from_the_config_stay_under_the_output_dir(path, key):
    """Whatever string a config gives as an output path: refused with one clear error, or it resolves to
    a location inside MONITOR_OUTPUT_DIR."""
    section, sub = key.split(".")
    try:
        cfg = parse_config({section: {sub: path}})
    except ConfigError as exc:
        assert f"'{key}'" in str(exc) and "relative to MONITOR_OUTPUT_DIR" in str(exc)
        return
    root = os.path.join(os.sep, "job", "out")
    target = os.path.normpath(os.path.join(root, getattr(getattr(cfg, section), sub)))
    assert os.path.commonpath([root, target]) == root, (path, target)


class _Job:
    """A small dynamic-mode training job kept alive across hypothesis examples."""

    def __init__(self, root: str) -> None:
        os.environ["DYNAMIC_MONITOR"] = "true"
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(root, "out")
        self.path = os.path.join(root, "cfg.json")
        self.good = {"wg_distribution": True, "ops": ["norm"], "dynamic_on": True}
        with open(self.path, "w") as fh:
            json.dump(self.good, fh)
        torch.manual_seed(0)
        self.model = nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.monitor = TrainerMon(self.path)
        self.monitor.set_monitor(self.model, optimizer=self.opt)

    def step(self) -> None:
        self.model(torch.ones(2, 3)).sum().backward()
        self.opt.step()
        self.opt.zero_grad()


def test_running_job_never_stops_or_changes_on_invalid_files(tmp_path):
    job = _Job(str(tmp_path))
    before = job.monitor.config
    seen = {"invalid": 0}

    @settings(max_examples=400, deadline=None)
    @given(raw=configs)
    def feed(raw):
        try:
            parse_config(raw)
            return  # valid configs are the dynamic tests' business
        except ConfigError:
            pass
        seen["invalid"] += 1
        with open(job.path, "w") as fh:
            json.dump(raw, fh, default=str)
        job.monitor.loop.control.watcher.dirty = True  # as if inotify had reported the save
        step = job.monitor.current_step
        job.step()
        assert job.monitor.current_step == step + 1
        assert job.monitor.config is before  # the running config is untouched
        assert job.monitor.loop.plan.collecting

    try:
        feed()
    finally:
        job.monitor.close()
        os.environ.pop("DYNAMIC_MONITOR", None)
    assert seen["invalid"] > 100
    assert job.monitor.faults.total == 0


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "made-in-a-helper"])
def test_interpreter_exit_flushes_and_does_not_hang(tmp_path, kept):
    """No close() call: the atexit handler flushes the worker and the process exits promptly, also for a
    monitor made in a helper function and not kept (its hooks go on collecting; the handler once held
    the monitor object only, found it gone at exit, and every step was lost)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "xy_distribution": True, "ops": ["norm"]}))
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from trainermon import TrainerMon
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def attach():
            monitor = TrainerMon({str(cfg)!r})
            monitor.set_monitor(model, optimizer=opt)
            return monitor
        monitor = attach()
        print(monitor.run_dir)
        if not {kept!r}:
            del monitor
            import gc
            gc.collect()
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        """
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("DYNAMIC_MONITOR", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    run_dir = done.stdout.strip().splitlines()[0]
    with open(os.path.join(run_dir, "grad_reduced_4-4.csv")) as fh:
        assert len(fh.read().splitlines()) == 1 + 4  # header + the last step's 4 parameters
