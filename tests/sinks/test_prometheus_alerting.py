"""What the shipped alerts rely on: a one-step spike stays on the page for `prometheus.max_window_s`
(`trainermon_global_grad_norm_max`), stopped collection leaves no old step's values behind
(`trainermon_collecting`), the shipped scrape config gives `trainermon_info` one `run_id`, and the shipped
rules pass their promtool unit tests (a stale gap among them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.helpers import LayeredNet as Net
from tests.sinks.prometheus_common import scrape, train_step, url_of, value
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.exporters.prometheus.window import WindowMax
from trainermon.failsafe import FaultLog
from trainermon.pipeline.worker import BackgroundWorker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROM = os.path.join(REPO, "deploy", "prometheus")
STEP_VALUES = ("trainermon_global_grad_norm", "trainermon_global_grad_norm_max", "trainermon_layer_stat")


def start(tmp_path, monkeypatch, **extra) -> tuple[TrainerMon, Net, torch.optim.Optimizer]:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "ops": ["norm", "max"], "format": ["prometheus"], **extra}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = TrainerMon(str(tmp_path / "cfg.json"))
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    return mon, model, opt


def global_norm(grads: dict) -> float:
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def test_a_one_step_spike_stays_on_the_page_for_the_window(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    mon, model, opt = start(tmp_path, monkeypatch, prometheus={"max_window_s": 1.5})
    gen = torch.Generator().manual_seed(1)
    url = url_of(mon)
    try:
        normal = [global_norm(train_step(model, opt, gen)) for _ in range(3)]
        spike = global_norm(train_step(model, opt, gen, scale=1000.0))  # one step
        after = [global_norm(train_step(model, opt, gen)) for _ in range(3)]
        mon.flush()
        s = scrape(url)
        assert value(s, "trainermon_global_grad_norm") == pytest.approx(after[-1], rel=1e-5)
        assert value(s, "trainermon_global_grad_norm_max") == pytest.approx(spike, rel=1e-5)
        assert spike > 100 * max(normal + after)
        assert scrape(url) == s  # a scrape resets nothing: a second scraper sees the spike too
        time.sleep(1.7)  # the window passed the spike, and every step: no value to show
        assert "trainermon_global_grad_norm_max" not in names(scrape(url))
        latest = global_norm(train_step(model, opt, gen))
        mon.flush()
        assert value(scrape(url), "trainermon_global_grad_norm_max") == pytest.approx(latest, rel=1e-5)
    finally:
        mon.close()


def test_window_max_keeps_the_largest_recent_value():
    now = [0.0]
    w = WindowMax(10.0, clock=lambda: now[0])
    assert w.current() is None
    for t, v in ((0, 1.0), (1, 5.0), (2, float("nan")), (3, 2.0), (4, 3.0)):
        now[0] = t
        w.add(v)
    assert w.current() == 5.0
    now[0] = 11.5  # 5.0 (t=1) left the window; 3.0 (t=4) outranks 2.0 (t=3)
    assert w.current() == 3.0
    w.add(float("inf"))
    assert w.current() == float("inf")
    now[0] = 30.0
    assert w.current() is None


def test_max_window_s_config():
    assert parse_config({}).prometheus.max_window_s == 60.0
    assert parse_config({"prometheus": {"max_window_s": 120}}).prometheus.max_window_s == 120.0
    for bad in (0, -5, 0.5, "60", True, None, float("nan"), 10**6):
        with pytest.raises(ConfigError, match=r"prometheus\.max_window_s.*allowed: a number of seconds in"):
            parse_config({"prometheus": {"max_window_s": bad}})


def test_collect_times_reached_drops_the_step_values(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    mon, model, opt = start(tmp_path, monkeypatch, collect_times=3)
    gen = torch.Generator().manual_seed(2)
    url = url_of(mon)
    try:
        train_step(model, opt, gen)
        mon.flush()
        s = scrape(url)
        assert value(s, "trainermon_collecting") == 1
        assert set(STEP_VALUES) <= names(s)
        for _ in range(5):
            train_step(model, opt, gen)
        mon.flush()
        s = scrape(url)
        assert value(s, "trainermon_collecting") == 0
        assert not set(STEP_VALUES) & names(s), sorted(names(s))
        assert "trainermon_monitor_step_seconds" not in names(s)
        assert value(s, "trainermon_last_step") == 2  # the last collected step stays, as do the counters
        assert value(s, "trainermon_steps_collected_total") == 3
    finally:
        mon.close()


def test_dynamic_off_drops_the_step_values_and_on_again_brings_them_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    base = {"dynamic_on": True, "dynamic_watch": "polling", "collect_times": 10**6}
    mon, model, opt = start(tmp_path, monkeypatch, **base)
    gen = torch.Generator().manual_seed(3)
    cfg = tmp_path / "cfg.json"
    written = json.loads(cfg.read_text())

    def train_until(predicate, what: str) -> dict:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            train_step(model, opt, gen)
            mon.flush()
            s = scrape(url_of(mon))
            if predicate(s):
                return s
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}")

    try:
        s = train_until(lambda s: "trainermon_global_grad_norm" in names(s), "a collected step")
        assert value(s, "trainermon_collecting") == 1
        cfg.write_text(json.dumps({**written, "dynamic_on": False}))
        s = train_until(lambda s: value(s, "trainermon_collecting") == 0, "collection to stop")
        assert not set(STEP_VALUES) & names(s), sorted(names(s))
        stopped_at = value(s, "trainermon_last_step")
        for _ in range(5):  # steps while off: nothing comes back
            train_step(model, opt, gen)
        mon.flush()
        s = scrape(url_of(mon))
        assert not set(STEP_VALUES) & names(s) and value(s, "trainermon_last_step") == stopped_at
        cfg.write_text(json.dumps({**written, "dynamic_on": True}))
        s = train_until(lambda s: value(s, "trainermon_collecting") == 1, "collection to start again")
        assert set(STEP_VALUES) <= names(s) and value(s, "trainermon_last_step") > stopped_at
    finally:
        mon.close()


def test_the_worker_tells_sinks_that_have_the_hook_after_the_queued_steps():
    calls: list = []

    class Plain:  # no hook: nothing happens to it
        def write(self, batch):
            calls.append("write")

        def flush(self):
            pass

        def close(self):
            pass

    class WithHook(Plain):
        def collection_stopped(self):
            calls.append("stopped")

    faults = FaultLog()
    worker = BackgroundWorker([Plain(), WithHook()], faults, derive=lambda payload: payload)
    try:
        worker.submit(SimpleNamespace(rows=[]))
        worker.collection_stopped()
        worker.flush(10)
        assert calls == ["write", "write", "stopped"]
    finally:
        worker.close(10)
    assert faults.total == 0


def test_the_shipped_scrape_config_gives_trainermon_info_one_run_id():
    """The discovery file's target label `run_id` and trainermon_info's own `run_id` (the same value)
    clash under Prometheus's default honor_labels: false (trainermon_info gets `exported_run_id` too):
    the shipped trainermon jobs honor the page's labels."""
    with open(os.path.join(PROM, "prometheus.yml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    jobs = [j for j in config["scrape_configs"] if j["job_name"].startswith("trainermon")]
    assert jobs and all(j.get("honor_labels") is True for j in jobs), jobs


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool (Debian's 'prometheus' package) is needed to test the shipped alert rules")
    return found


def test_the_shipped_rules_pass_their_unit_tests():
    checks = (["check", "rules", "trainermon_alerts.yml"], ["test", "rules", "trainermon_alerts_test.yml"])
    for args in checks:
        done = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=PROM)
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    with open(os.path.join(PROM, "trainermon_alerts_test.yml"), encoding="utf-8") as fh:
        tests = {t["name"] for t in yaml.safe_load(fh)["tests"]}
    assert {"a failed scrape does not fire the counter alerts again", "collection switched off"} <= tests


def test_escalation_steps_after_the_stop_put_no_step_values_back(tmp_path, monkeypatch):
    """An anomaly at the last collected step escalates activations over the next steps, after collection
    stopped: their gauges came back on the page (collecting 0 beside step-5 layer stats) and no later
    collected step would take them off. They are counted (last_step, non-finite) and left off the page."""
    from tests.sinks.test_prometheus_reopen import _derived_batch, _sink

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        sink.write(_derived_batch(4, families=("grad_reduced", "actv"), global_grad_norm=2.0))
        sink.collection_stopped()
        sink.write(_derived_batch(5, families=("actv",), scheduled=False))  # escalation after the stop
        s = scrape(url)
        assert value(s, "trainermon_collecting") == 0 and value(s, "trainermon_last_step") == 5
        assert not {"trainermon_layer_stat", "trainermon_monitor_step_seconds"} & names(s), names(s)
        sink.write(_derived_batch(6, families=("grad_reduced",), global_grad_norm=1.0))  # collecting again
        s = scrape(url)
        assert value(s, "trainermon_collecting") == 1
        assert {"trainermon_layer_stat", "trainermon_monitor_step_seconds"} <= names(s)
    finally:
        sink.close()
