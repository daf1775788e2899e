"""Reliability under faults (issue 11), load: concurrent Prometheus scrapes while training.

docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

from tests.reliability.faults import REPO


def test_scrape_load_every_scrape_succeeds_and_is_well_formed():
    """The short version of benchmarks/prometheus_load.py: 8 clients, 300 scrapes (at most 60 s)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prometheus_load", REPO / "benchmarks" / "prometheus_load.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.run_load(
        clients=8,
        seconds=60,
        max_scrapes=300,
        interval=0.05,  # at most 160 scrapes/s: the window spans several 0.5 s page updates on any host
        quiet_seconds=0.3,
        width=64,
        layers=4,
        parse=True,
    )
    s = r["scrape"]
    assert s["failed"] == 0 and s["malformed"] == 0, s["errors"]
    assert s["ok"] == s["started"] and s["ok"] == 300, s  # every scrape answered, the count reached
    assert s["wall_s"] < 60 + 10  # bounded in time (a scrape times out after 10 s at worst)
    assert s["regressions"] == 0  # no client ever saw trainermon_last_step go back
    first, last = s["training_steps_during"]
    assert last - first >= 10 and s["last_step_seen"] > s["first_step_seen"]  # training went on
    assert r["faults"] == 0 and r["dropped_rows"] == 0
    t = r["step_ms"]
    assert t["monitored_scraped"] < 5 * t["monitored_quiet"] + 20, t  # loose: 2 shared cores
    print("\n" + bench._report(r))
