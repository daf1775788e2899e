"""End to end: a real Prometheus (Debian's package), with the shipped file_sd scrape job, scrapes a
monitored demo run on 127.0.0.1, the shipped alert rules see a gradient spike of one step (training goes
on after it), and every PromQL expression of the shipped Grafana dashboard parses and returns data. The
shipped rules' promtool unit tests run here too.

Installs the `prometheus` package with apt-get when it is missing; without apt-get (or root) the test
fails with a message saying so, rather than passing silently.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import torch
import yaml
from torch import nn

from tests.distributed import free_port
from trainermon import TrainerMon
from trainermon.demo import TinyGPT, synthetic_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(REPO, "deploy", "prometheus", "trainermon_alerts.yml")
RULES_TEST = os.path.join(REPO, "deploy", "prometheus", "trainermon_alerts_test.yml")
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "trainermon_dashboard.json")
SCRAPE_CONFIG = os.path.join(REPO, "deploy", "prometheus", "prometheus.yml")


def ensure_prometheus() -> tuple[str, str]:
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        if shutil.which("apt-get") is None:
            pytest.fail(
                "the end-to-end test needs Debian's 'prometheus' package (prometheus and promtool), "
                "which is not installed, and apt-get is not available to install it"
            )
        if os.geteuid() != 0:
            pytest.fail("prometheus is not installed and installing it with apt-get needs root")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
        ):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        pytest.fail("apt-get installed 'prometheus' but the prometheus/promtool binaries are not on PATH")
    return prometheus, promtool


def api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except OSError as exc:  # not up yet
            last = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def dashboard_queries() -> list[tuple[str, str]]:
    with open(DASHBOARD, encoding="utf-8") as fh:
        dash = json.load(fh)
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            # Grafana's variables as Grafana would substitute them for "All ranks".
            expr = target["expr"].replace("$__rate_interval", "20s")
            for variable in ("$rank", "$run_id", "$job"):
                expr = expr.replace(variable, ".*")
            out.append((panel["title"], expr))
    return out


def prometheus_config(sd_glob: str) -> str:
    """The shipped config's file_sd job (its scrape options as shipped), on this run's directory, with the
    shipped rules, scraping and evaluating every second."""
    with open(SCRAPE_CONFIG, encoding="utf-8") as fh:
        shipped = yaml.safe_load(fh)
    job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "trainermon")
    job["file_sd_configs"] = [{"files": [sd_glob], "refresh_interval": "1s"}]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [RULES],
        "scrape_configs": [job],
    }
    return yaml.safe_dump(config)


class Trainer(threading.Thread):
    """The demo model trained in a thread; `spike` multiplies one step's gradients (then training goes
    on: the spike lasts one step, shorter than a scrape interval)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(daemon=True)
        self.model, self.opt = model, opt
        self.spike = threading.Event()
        self.stop = threading.Event()
        self.spiked_step: int | None = None
        self.steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        gen = torch.Generator().manual_seed(0)
        try:
            while not self.stop.is_set():
                x, y = synthetic_batch(gen, 4, 16, 64)
                loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
                loss.backward()
                if self.spike.is_set() and self.spiked_step is None:
                    for p in self.model.parameters():
                        p.grad.mul_(1000.0)
                    self.spiked_step = self.steps
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.steps += 1
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_prometheus_end_to_end(tmp_path, out_dir):
    prometheus, promtool = ensure_prometheus()
    started = time.monotonic()

    # The shipped rules are valid and pass their unit tests.
    for cmd in ([promtool, "check", "rules", RULES], [promtool, "test", "rules", RULES_TEST]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=os.path.dirname(RULES))
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr

    out = out_dir
    cfg = {
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["norm", "min", "max", "mean", "nans", "infs"],
        "format": ["prometheus"],
        "alert": {"rules": [{"rule_name": "AnomalySpike"}], "dump": False},  # TrainermonAnomaly
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(str(tmp_path / "cfg.json"))
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    trainer = Trainer(model, opt)

    web_port = free_port()
    base = f"http://127.0.0.1:{web_port}"
    (tmp_path / "prometheus.yml").write_text(prometheus_config(f"{out}/prometheus_sd/*.json"))
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    try:
        trainer.start()
        wait_for(lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200, 30, "Prometheus")

        def target_up():
            active = api(base, "/api/v1/targets")["data"]["activeTargets"]
            return [t for t in active if t["health"] == "up"]

        wait_for(target_up, 30, "the rank's target to be discovered via file_sd and up")

        # Enough normal history for the spike rule (10 samples of the window's largest global norm).
        def history():
            r = api(base, "/api/v1/query", query="count_over_time(trainermon_global_grad_norm_max[30m])")
            return r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 12

        wait_for(history, 40, "12 scraped samples of trainermon_global_grad_norm_max")
        normal = float(
            api(base, "/api/v1/query", query="trainermon_global_grad_norm")["data"]["result"][0]["value"][1]
        )
        alerts = api(base, "/api/v1/alerts")["data"]["alerts"]
        assert not [a for a in alerts if a["labels"]["alertname"] == "TrainermonGradNormSpike"]

        trainer.spike.set()

        def spike_firing():
            found = api(base, "/api/v1/alerts")["data"]["alerts"]
            return [
                a
                for a in found
                if a["labels"]["alertname"] == "TrainermonGradNormSpike" and a["state"] == "firing"
            ]

        firing = wait_for(spike_firing, 30, "the TrainermonGradNormSpike alert to fire")
        assert firing[0]["labels"]["rank"] == "0" and firing[0]["labels"]["severity"] == "warning"
        assert float(firing[0]["value"]) > 100 * normal  # gradients x1000: the norm x1000
        assert trainer.error is None and trainer.spiked_step is not None
        # ... while the last step's norm is back to normal: one step, between two scrapes
        assert trainer.steps > trainer.spiked_step + 5
        last = api(base, "/api/v1/query", query="trainermon_global_grad_norm")["data"]["result"]
        assert float(last[0]["value"][1]) < 10 * normal

        # One run_id label on trainermon_info (the page's and the discovery file's agree, not doubled).
        info = api(base, "/api/v1/query", query="trainermon_info")["data"]["result"][0]["metric"]
        assert info["run_id"] == mon.run_dir.rsplit("-", 1)[-1] and "exported_run_id" not in info, info

        # The monitor's own rule saw the spike too, and its counter's alert fires, by rule.
        def anomaly_firing():
            found = api(base, "/api/v1/alerts")["data"]["alerts"]
            name = "TrainermonAnomaly"
            return [a for a in found if a["labels"]["alertname"] == name and a["state"] == "firing"]

        firing = wait_for(anomaly_firing, 30, "the TrainermonAnomaly alert to fire")
        assert firing[0]["labels"]["rule"] == "AnomalySpike" and firing[0]["labels"]["rank"] == "0"

        # Every expression of the dashboard parses and returns data from this run.
        failures = []
        for title, expr in dashboard_queries():
            result = api(base, "/api/v1/query", query=expr)
            if result["status"] != "success" or not result["data"]["result"]:
                failures.append(f"{title}: {expr} -> {result}")
        assert not failures, "\n".join(failures)
        assert len(dashboard_queries()) >= 10
    finally:
        trainer.stop.set()
        trainer.join(30)
        mon.close()
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    assert time.monotonic() - started < 120
