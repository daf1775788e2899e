"""Scrape load on a training rank's Prometheus endpoint (loopback), and what it costs the training loop.

A small model trains with the Prometheus sink on 127.0.0.1 (an ephemeral port) while a separate scraper
process runs N client threads that GET /metrics back to back (a new connection per scrape, as Prometheus
without keep-alive does) for a bounded time and number of scrapes. Every response is checked: status 200,
the exposition content type, a body as long as its Content-Length, the fixed trainermon series present,
and `trainermon_last_step` never going back for a client; with --parse, every page is parsed with
prometheus_client's parser as well.

Phases, all in one process with the same model and batch: no monitor; monitored without scrapes;
monitored while scraped; monitored without scrapes again. Reported: scrape latency p50/p90/p99/max,
scrapes/s, failures, malformed pages, and the median training step time of each phase.

Run:  .venv/bin/python benchmarks/prometheus_load.py [--clients 16] [--seconds 10] [--json out.json]
      .venv/bin/python benchmarks/prometheus_load.py --quick      # ~10 s smoke run
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REQUIRED = (b"trainermon_info{", b"trainermon_last_step{", b"trainermon_dropped_records_total{")
CONTENT_TYPE = "text/plain; version=0.0.4"


# ---- scraper (its own process: no torch import) ------------------------------------------------
def scrape_loop(
    host: str, port: int, clients: int, seconds: float, max_scrapes: int, parse: bool, interval: float = 0.0
) -> dict:
    """Scrape until `seconds` pass or `max_scrapes` scrapes are done (each client pausing `interval`
    seconds between scrapes; 0: back to back); return counts and latencies."""
    if parse:
        from prometheus_client.parser import text_string_to_metric_families
    lock = threading.Lock()
    state = {"started": 0, "ok": 0, "failed": 0, "malformed": 0, "regressions": 0, "bytes": 0}
    latencies: list[float] = []
    errors: list[str] = []
    steps_seen: list[float] = []
    end = time.monotonic() + seconds

    def one_client() -> None:
        last = -1.0
        while time.monotonic() < end:
            if interval and state["started"]:
                time.sleep(interval)
            with lock:
                if state["started"] >= max_scrapes:
                    return
                state["started"] += 1
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(host, port, timeout=10)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    state["failed"] += 1
                    if len(errors) < 5:
                        errors.append(f"{type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - t0
            problem = None
            if resp.status != 200:
                problem = f"status {resp.status}"
            elif not (resp.getheader("Content-Type") or "").startswith(CONTENT_TYPE):
                problem = f"content type {resp.getheader('Content-Type')!r}"
            elif int(resp.getheader("Content-Length") or -1) != len(body) or not body.endswith(b"\n"):
                problem = "truncated body"
            elif not all(key in body for key in REQUIRED):
                problem = "a required series is missing"
            step = last
            if problem is None:
                try:
                    if parse:
                        names = {
                            s.name: s.value
                            for family in text_string_to_metric_families(body.decode())
                            for s in family.samples
                        }
                        step = names["trainermon_last_step"]
                    else:
                        line = body.split(b"trainermon_last_step{", 1)[1].split(b"\n", 1)[0]
                        step = float(line.rsplit(b" ", 1)[1])
                except Exception as exc:  # noqa: BLE001
                    problem = f"unparsable: {exc}"
            with lock:
                if problem is not None:
                    state["malformed"] += 1
                    if len(errors) < 5:
                        errors.append(problem)
                    continue
                state["ok"] += 1
                state["bytes"] = len(body)
                latencies.append(elapsed)
                if step < last:
                    state["regressions"] += 1
                steps_seen.append(step)
            last = step

    t0 = time.monotonic()
    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

    return {
        **state,
        "clients": clients,
        "interval_s": interval,
        "wall_s": wall,
        "scrapes_per_s": state["ok"] / wall if wall else 0.0,
        "latency_ms": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": pct(1.0)},
        "last_step_seen": max(steps_seen) if steps_seen else -1,
        "first_step_seen": min(steps_seen) if steps_seen else -1,
        "errors": errors,
    }


# ---- training side -----------------------------------------------------------------------------
def _model(width: int, layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(32, width)


def _phase(model, opt, batch, seconds: float, min_steps: int, until=None) -> list[float]:
    """Train for `seconds` (or until `until()` is true), at least `min_steps`; return step times."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while len(times) < min_steps or (until() is False if until else time.monotonic() < end):
        t0 = time.perf_counter()
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if len(times) > 100_000:
            break
    return times


def run_load(
    clients: int = 16,
    seconds: float = 10.0,
    max_scrapes: int = 1_000_000,
    quiet_seconds: float = 3.0,
    width: int = 256,
    layers: int = 8,
    parse: bool = False,
    per_parameter: bool = False,
    threads: int = 1,
    interval: float = 0.0,
) -> dict[str, Any]:
    import torch

    from trainermon import TrainerMon

    torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "config": {
            "clients": clients,
            "seconds": seconds,
            "max_scrapes": max_scrapes,
            "width": width,
            "layers": layers,
            "parse": parse,
            "per_parameter": per_parameter,
            "torch_threads": threads,
            "interval": interval,
        }
    }
    model, opt, batch = _model(width, layers)
    _phase(model, opt, batch, 0.0, 5)
    bare = _phase(model, opt, batch, quiet_seconds, 20)

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(tmp, "out")
        os.environ.pop("DYNAMIC_MONITOR", None)
        cfg = os.path.join(tmp, "cfg.json")
        with open(cfg, "w") as fh:
            json.dump(
                {
                    "wg_distribution": True,
                    "param_distribution": True,
                    "ops": ["norm", "min", "max", "mean", "nans"],
                    "format": ["prometheus"],
                    "prometheus": {"per_parameter": per_parameter},
                },
                fh,
            )
        model, opt, batch = _model(width, layers)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        try:
            exporter = mon.loop.worker.exporters[0]
            host, port = exporter.host, exporter.port
            _phase(model, opt, batch, 0.0, 5)
            quiet_before = _phase(model, opt, batch, quiet_seconds, 20)
            cmd = [sys.executable, os.path.abspath(__file__), "--scrape", f"{host}:{port}"]
            cmd += ["--clients", str(clients), "--seconds", str(seconds), "--max-scrapes", str(max_scrapes)]
            cmd += ["--interval", str(interval)] + (["--parse"] if parse else [])
            scraper = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            try:
                assert scraper.stdout is not None and scraper.stdout.readline().strip() == "ready"
                step_before = mon.current_step
                scraped = _phase(model, opt, batch, 0.0, 1, until=lambda: scraper.poll() is not None)
                steps_during = (step_before, mon.current_step - 1)
                out, _ = scraper.communicate(timeout=seconds + 60)
            finally:
                if scraper.poll() is None:
                    scraper.kill()
                    scraper.wait(10)
            quiet_after = _phase(model, opt, batch, quiet_seconds, 20)
            mon.flush()
            result["dropped_rows"] = mon.dropped_rows
            result["faults"] = mon.faults.total
        finally:
            mon.close()
    result["scrape"] = json.loads(out.strip().splitlines()[-1])
    result["scrape"]["training_steps_during"] = list(steps_during)
    quiet = quiet_before + quiet_after
    result["step_ms"] = {
        "no_monitor": statistics.median(bare) * 1e3,
        "monitored_quiet": statistics.median(quiet) * 1e3,
        "monitored_scraped": statistics.median(scraped) * 1e3,
        "steps": {"no_monitor": len(bare), "quiet": len(quiet), "scraped": len(scraped)},
    }
    result["step_ms"]["scraped_over_quiet"] = (
        result["step_ms"]["monitored_scraped"] / result["step_ms"]["monitored_quiet"]
    )
    return result


def _report(r: dict[str, Any]) -> str:
    s, t = r["scrape"], r["step_ms"]
    lat = s["latency_ms"]
    return "\n".join(
        [
            f"scrapes: {s['ok']} ok, {s['failed']} failed, {s['malformed']} malformed, "
            f"{s['regressions']} step regressions; {s['clients']} clients (pause {s['interval_s']} s) "
            f"for {s['wall_s']:.1f} s "
            f"= {s['scrapes_per_s']:.0f} scrapes/s; page {s['bytes']} bytes",
            f"scrape latency ms: p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}  "
            f"max {lat['max']:.2f}",
            f"training step ms (median): no monitor {t['no_monitor']:.2f}, "
            f"monitored {t['monitored_quiet']:.2f}, monitored while scraped {t['monitored_scraped']:.2f} "
            f"(x{t['scraped_over_quiet']:.2f}); steps {t['steps']}",
            f"steps while scraped: {s['training_steps_during']}; scrapers saw last_step "
            f"{s['first_step_seen']:.0f}..{s['last_step_seen']:.0f}; dropped rows {r['dropped_rows']}, "
            f"faults {r['faults']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0, help="scraping time (bounded)")
    p.add_argument("--max-scrapes", type=int, default=1_000_000, help="scrapes in all (bounded)")
    p.add_argument("--quiet-seconds", type=float, default=3.0, help="each phase without scrapes")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--interval", type=float, default=0.0, help="pause of each client between scrapes")
    p.add_argument("--parse", action="store_true", help="parse every page with prometheus_client")
    p.add_argument("--per-parameter", action="store_true", help="per-parameter series (a larger page)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 clients, 2 s, small phases")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--scrape", help=argparse.SUPPRESS)  # host:port: run as the scraper process
    a = p.parse_args(argv)
    if a.scrape:
        host, port = a.scrape.rsplit(":", 1)
        print("ready", flush=True)  # the training side times the scraped phase from here
        print(
            json.dumps(scrape_loop(host, int(port), a.clients, a.seconds, a.max_scrapes, a.parse, a.interval))
        )
        return 0
    if a.quick:
        a.clients, a.seconds, a.quiet_seconds = 8, 2.0, 0.5
    result = run_load(
        a.clients,
        a.seconds,
        a.max_scrapes,
        a.quiet_seconds,
        a.width,
        a.layers,
        a.parse,
        a.per_parameter,
        a.threads,
        a.interval,
    )
    print(_report(result))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
