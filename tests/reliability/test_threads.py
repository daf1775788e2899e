"""Reliability under faults (issue 11), thread hygiene: close() is idempotent, flushes everything and joins
every thread; an interpreter exit without close() is prompt and loses nothing; a hung sink cannot make
flush() or close() hang.

docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import trainermon.exporters.csv as csv_mod
from tests.helpers import read_family, write_config
from tests.reliability.faults import REPO, _exporter, _scrape, _small_model, _steps
from trainermon import TrainerMon


def _foreign_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def test_close_is_idempotent_flushes_everything_and_joins_every_thread(
    tmp_path, dynamic_mode, out_dir, monkeypatch
):
    import pyarrow.parquet  # noqa: F401 - imported untimed (~1.5 s cold), not by the sink

    import trainermon.exporters.prometheus.server as server

    # A close() that waited for the idle client would now wait 120 s, far above any loaded host's time.
    monkeypatch.setattr(server.Handler, "timeout", 120)
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 1000, "seconds_per_part": None},  # only close() completes the part
    )
    before = set(threading.enumerate())
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    port = _exporter(mon, "PrometheusExporter").port
    _steps(model, opt, 5)
    _scrape(port)
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # a scraper that never sends
    time.sleep(0.2)  # the server has accepted it: a handler thread waits for its request
    started = _foreign_threads(before)
    assert {"trainermon-worker", "trainermon-prometheus"} <= set(started), started
    assert len(started) >= 4, started  # + the config watcher's observer and emitter, + the idle handler
    try:
        t0 = time.monotonic()
        mon.close()
        took = time.monotonic() - t0
        mon.close()  # idempotent: nothing to do, nothing raised
        left = _foreign_threads(before)
    finally:
        idle.close()
    assert left == [], f"threads still running after close(): {left}"
    assert took < 60, took
    print(f"\nclose(): {len(started)} monitor threads {started} joined in {took:.3f} s")
    # Everything was flushed: the last step is in the CSV and in the Parquet part that close() completed.
    assert {int(r["step"]) for r in read_family(mon.run_dir, "grad_reduced")} == set(range(5))
    import trainermon as tm

    assert sorted(set(tm.load(tmp_path / "out").column("step").to_pylist())) == list(range(5))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, time, urllib.request
    import torch
    from torch import nn
    from trainermon import TrainerMon
    import trainermon.exporters.prometheus.server as server
    server.Handler.timeout = 120  # an exit that waited for the idle client would take 120 s
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(sys.argv[1])
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(6):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    port = monitor.loop.worker.exporters[-1].port
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    idle = socket.create_connection(("127.0.0.1", port))  # still connected at exit, never sends
    print(monitor.run_dir, flush=True)
    print(time.monotonic(), flush=True)
    # no close(): the interpreter exits with the worker, watcher and HTTP threads running
    """
)


def test_interpreter_exit_without_close_with_every_thread_running(tmp_path):
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 1000, "seconds_per_part": None},
    )
    (tmp_path / "exit.py").write_text(EXIT_SCRIPT)
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out"), "DYNAMIC_MONITOR": "true"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "exit.py"), cfg], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    ended = time.monotonic()
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir, last_line = done.stdout.split()[-2:]
    exit_took = ended - float(last_line)  # from the script's last line to the process being reaped
    assert exit_took < 60, exit_took
    print(f"\nexit without close(): process gone {exit_took:.3f} s after its last line")
    assert {int(r["step"]) for r in read_family(run_dir, "grad_reduced")} == set(range(6))
    import trainermon as tm

    assert sorted(set(tm.load(tmp_path / "out").column("step").to_pylist())) == list(range(6))
    assert not glob.glob(str(tmp_path / "out" / "prometheus_sd" / "*.json"))  # target withdrawn at exit
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


class _HungSink:
    """CSV writes that hang (a dead NFS server) until released."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr(csv_mod.CsvExporter, "write", self.write)

    def write(self, *args) -> None:
        self.entered.set()
        self.release.wait(60)


def _hung_monitor(tmp_path, monkeypatch) -> tuple[TrainerMon, _HungSink]:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], queue_size=1)
    sink = _HungSink(monkeypatch)
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    _steps(model, opt, 1)
    assert sink.entered.wait(10)  # step 0 hangs in the sink ...
    _steps(model, opt, 3)  # ... step 1 waits in the full queue, steps 2 and 3 are dropped
    assert mon.dropped_rows == 2 * 8
    return mon, sink


def _returns_within(fn, seconds: float) -> tuple[bool, list[BaseException], threading.Thread]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), errors, thread


def test_flush_with_a_hung_sink_returns_without_raising(tmp_path, monkeypatch):
    mon, sink = _hung_monitor(tmp_path, monkeypatch)
    try:
        returned, errors, _ = _returns_within(lambda: mon.flush(timeout=0.5), 15.0)  # hung: 60 s
    finally:
        sink.release.set()
        mon.close()
    assert returned and errors == [], errors


def test_close_with_a_hung_sink_is_bounded(tmp_path, monkeypatch):
    mon, sink = _hung_monitor(tmp_path, monkeypatch)
    try:
        returned, errors, thread = _returns_within(lambda: mon.loop.worker.close(timeout=0.5), 15.0)
    finally:
        sink.release.set()
        mon.close()
        thread.join(10)
    assert returned and errors == [], errors


@pytest.mark.parametrize("stuck_in", ["write", "flush"])
def test_a_hung_sink_is_switched_off_and_the_others_go_on(tmp_path, monkeypatch, stuck_in):
    """CSV stuck in one call (a dead NFS mount) for HUNG_S: one counted fault, and a new worker thread
    writes every step to Parquet (the step being written when it hung included) and serves flush and
    state_dict promptly; before, the one worker thread stalled every sink and each flush waited out its
    timeout. The stuck call, when released, writes nothing more."""
    import pyarrow.parquet  # noqa: F401 - imported now: a first import inside a write may take ~1 s

    import trainermon.pipeline.worker as worker_mod

    monkeypatch.setattr(worker_mod, "HUNG_S", 2.0)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    entered, release = threading.Event(), threading.Event()
    calls = {"write": 0, "flush": 0, "after": 0}
    stuck_thread = []
    real = {name: getattr(csv_mod.CsvExporter, name) for name in ("write", "flush")}

    def stuck(name):
        def call(self, *args):
            calls[name] += 1
            if name == stuck_in and not entered.is_set():
                stuck_thread.append(threading.current_thread())
                entered.set()
                release.wait(30)
                calls["after"] += 1  # returned: the thread must stop without another call
                return None
            return real[name](self, *args)

        return call

    for name in real:
        monkeypatch.setattr(csv_mod.CsvExporter, name, stuck(name))
    cfg = write_config(
        tmp_path / "cfg.json",
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet"],
        write_interval_s=0,
        parquet={"steps_per_part": 1, "seconds_per_part": None},
    )
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    try:
        _steps(model, opt, 1)
        if stuck_in == "flush":
            returned, errors, _ = _returns_within(lambda: mon.flush(timeout=20), 0.0)  # a flush gets stuck
        assert entered.wait(10)
        time.sleep(2.1)
        _steps(model, opt, 3)  # the first submit after HUNG_S notices
        start = time.monotonic()
        state = mon.state_dict()  # flushes: served by the new thread
        took = time.monotonic() - start
        assert took < 20 and state["step"] == 4, (took, state)  # before: stuck till release (30 s)
        import trainermon as tm

        parquet_steps = sorted(set(tm.load(tmp_path / "out").column("step").to_pylist()))
        assert parquet_steps == [0, 1, 2, 3]
        assert mon.faults.counts == {"exporter CsvExporter hung": 1}, dict(mon.faults.counts)
        assert mon.dropped_rows == 0
        written = dict(calls)
    finally:
        release.set()
        for thread in stuck_thread:
            thread.join(30)  # its call returned and the thread stopped
        mon.close()
    assert not stuck_thread[0].is_alive()
    assert calls == {**written, "after": 1}  # released: no call after it, not even close's flush


def test_close_with_a_hung_sink_still_writes_the_others(tmp_path, monkeypatch):
    """CSV stuck in the final flush at close() (a dead NFS mount): close() switches it off after HUNG_S
    like the run does, and Parquet still writes and closes every step it held. Before, close() only
    waited out its timeout and returned with Parquet's part never written (0 of its rows)."""
    import pyarrow.parquet  # noqa: F401 - imported now: a first import inside a write may take ~1 s

    import trainermon.pipeline.worker as worker_mod

    monkeypatch.setattr(worker_mod, "HUNG_S", 2.0)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    release = threading.Event()
    stuck_thread = []
    real_flush = csv_mod.CsvExporter.flush

    def flush(self):
        if closing.is_set():
            stuck_thread.append(threading.current_thread())
            release.wait(60)
            return None
        return real_flush(self)

    closing = threading.Event()
    monkeypatch.setattr(csv_mod.CsvExporter, "flush", flush)
    cfg = write_config(
        tmp_path / "cfg.json",
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet"],
        parquet={"steps_per_part": 1000, "seconds_per_part": None},  # only close() completes the part
    )
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    try:
        _steps(model, opt, 4)
        closing.set()
        start = time.monotonic()
        mon.close()
        took = time.monotonic() - start
    finally:
        release.set()
        for thread in stuck_thread:
            thread.join(30)
    import trainermon as tm

    assert stuck_thread, "the CSV flush at close was never reached"
    assert took < 2.0 + 10, took  # HUNG_S, then the other sinks' flush and close
    steps = tm.load(tmp_path / "out").column("step").to_pylist()
    assert sorted(set(steps)) == [0, 1, 2, 3]
    assert [steps.count(s) for s in range(4)] == [steps.count(0)] * 4 and steps.count(0) > 0, steps
    assert mon.faults.counts == {"exporter CsvExporter hung": 1}, dict(mon.faults.counts)
