"""The background worker's hand-off: batched wake-ups, bounded waiting list, flush and interval changes."""

from __future__ import annotations

import threading
import time

import torch

from trainermon.collect.records import RowMeta, StepPayload
from trainermon.failsafe import FaultLog
from trainermon.pipeline.derive import Deriver
from trainermon.pipeline.worker import BackgroundWorker
from trainermon.stats import NUM_PARTIALS

_derive = Deriver(FaultLog())


class Recorder:
    """An exporter that remembers the steps it was given, in order, and when."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.flushes = 0
        self.closed = False
        self.written = threading.Event()

    def write(self, batch) -> None:
        self.steps.append(batch.step)
        self.written.set()

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def payload(step: int) -> StepPayload:
    row = RowMeta("grad_reduced", 0, "w", None, (2,), torch.float32, 2)
    return StepPayload(step=step, rows=(row,), partials=torch.ones(1, NUM_PARTIALS, dtype=torch.float64))


def wait_for(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_steps_wait_for_the_interval_then_go_out_together_in_order():
    sink = Recorder()
    worker = BackgroundWorker([sink], FaultLog(), _derive, queue_size=64, interval_s=2.0)
    try:
        time.sleep(0.05)  # let the worker reach its wait
        t0 = time.monotonic()
        for step in range(5):
            assert worker.submit(payload(step))
        time.sleep(0.1)
        assert sink.steps == []  # a hand-off wakes nobody: nothing written yet
        assert sink.written.wait(20)
        assert wait_for(lambda: len(sink.steps) == 5)
        assert sink.steps == [0, 1, 2, 3, 4]
        assert time.monotonic() - t0 < 15.0  # the interval, not close() or the 60 s default path
        assert worker.written_batches == 5 and worker.dropped_rows == 0
    finally:
        worker.close()
    assert sink.closed


def test_half_full_wakes_the_worker_before_the_interval():
    sink = Recorder()
    worker = BackgroundWorker([sink], FaultLog(), _derive, queue_size=4, interval_s=60.0)
    try:
        time.sleep(0.05)
        worker.submit(payload(0))
        time.sleep(0.1)
        assert sink.steps == []
        worker.submit(payload(1))  # 2 of 4 waiting: half full
        assert wait_for(lambda: sink.steps == [0, 1]), sink.steps  # 30 s, far below the 60 s interval
    finally:
        worker.close()


def test_full_list_drops_and_counts_and_flush_writes_the_rest():
    sink = Recorder()
    worker = BackgroundWorker([sink], FaultLog(), _derive, queue_size=2, interval_s=60.0)
    gate = threading.Event()
    original = sink.write

    def slow_write(batch):
        gate.wait(10)
        original(batch)

    sink.write = slow_write
    try:
        worker.submit(payload(0))  # wakes the worker (1 of 2 is half full); it blocks in the sink
        assert wait_for(lambda: not worker._pending)
        results = [worker.submit(payload(s)) for s in (1, 2, 3, 4)]
        assert results == [True, True, False, False]
        assert worker.dropped_rows == 2
        gate.set()
        worker.flush(10)
        assert sink.steps == [0, 1, 2] and sink.flushes == 1
    finally:
        gate.set()
        worker.close()


def test_interval_zero_writes_each_step_without_a_flush():
    sink = Recorder()
    worker = BackgroundWorker([sink], FaultLog(), _derive, queue_size=64, interval_s=0)
    try:
        for step in range(3):
            worker.submit(payload(step))
            assert wait_for(lambda s=step: sink.steps[-1:] == [s]), sink.steps
    finally:
        worker.close()


def test_interval_change_applies_to_a_waiting_worker():
    sink = Recorder()
    worker = BackgroundWorker(
        [sink], FaultLog(), _derive, queue_size=64, interval_s=0
    )  # waits with no timeout
    try:
        time.sleep(0.05)
        worker.set_interval(0.2)
        time.sleep(0.05)
        worker.submit(payload(7))  # not half full, so only the new interval can write it
        assert wait_for(lambda: sink.steps == [7]), sink.steps
    finally:
        worker.close()


def test_close_writes_what_is_waiting():
    sink = Recorder()
    worker = BackgroundWorker([sink], FaultLog(), _derive, queue_size=64, interval_s=60.0)
    for step in range(3):
        worker.submit(payload(step))
    worker.close(timeout=10)
    assert sink.steps == [0, 1, 2] and sink.closed
    assert not worker.submit(payload(3))  # closed: refused, nothing raised


def test_monitor_takes_the_interval_from_its_config_and_a_reload(tmp_path, out_dir, static_mode):
    from torch import nn

    from tests.helpers import read_family, write_config
    from trainermon import TrainerMon, parse_config

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], write_interval_s=60)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)

    def step() -> None:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    try:
        assert mon.loop.worker.interval_s == 60.0
        for _ in range(3):
            step()
        time.sleep(0.2)
        assert read_family(mon.run_dir, "grad_reduced") == []  # held for the interval
        mon.flush()
        assert [int(r["step"]) for r in read_family(mon.run_dir, "grad_reduced")] == [0, 0, 1, 1, 2, 2]
        mon.loop._reload(parse_config({"wg_distribution": True, "ops": ["norm"], "write_interval_s": 0}))
        assert mon.loop.worker.interval_s == 0.0
        step()
        assert wait_for(lambda: len(read_family(mon.run_dir, "grad_reduced")) == 8)
    finally:
        mon.close()


class _StuckSink:
    """A sink on a dead mount: `stuck_in` ("flush" or "close") waits for `release` once closing."""

    def __init__(self, stuck_in: str | None, release: threading.Event) -> None:
        self.stuck_in, self.release, self.calls = stuck_in, release, []

    def write(self, batch) -> None:
        self.calls.append("write")

    def flush(self) -> None:
        self.calls.append("flush")
        if self.stuck_in == "flush":
            self.release.wait(120)

    def close(self) -> None:
        self.calls.append("close")
        if self.stuck_in == "close":
            self.release.wait(120)


def _close_with(monkeypatch, stuck: list[str | None], hung_s: float, timeout: float | None):
    import trainermon.pipeline.worker as worker_mod

    monkeypatch.setattr(worker_mod, "HUNG_S", hung_s)
    release = threading.Event()
    sinks = [_StuckSink(s, release) for s in stuck]
    faults = FaultLog()
    worker = BackgroundWorker(sinks, faults, _derive, interval_s=0)
    start = time.monotonic()
    try:
        worker.close() if timeout is None else worker.close(timeout)
        took = time.monotonic() - start
    finally:
        release.set()
    return sinks, faults, took


def test_close_is_bounded_when_a_sink_hangs_in_its_own_close(monkeypatch):
    """Before: close() ran every exporter's close() on the caller's thread with no bound: stuck for good
    (the interpreter's exit held), and the sinks after it never closed."""
    sinks, faults, took = _close_with(monkeypatch, ["close", None], hung_s=1.0, timeout=5.0)
    assert took < 1.0 + 4.0, took  # HUNG_S for the stuck close, then the other's
    assert sinks[1].calls == ["flush", "close"]
    assert dict(faults.counts) == {"exporter _StuckSink.close hung": 1}


def test_close_with_three_sinks_hung_in_flush_still_closes_the_fourth(monkeypatch):
    """A dead mount hangs every file sink: each is switched off after HUNG_S, and the default timeout
    (HUNG_S + 10) is renewed for the sinks after it. Before: it covered the hangs that fit in it once
    (here the third is switched off at 15 s at the earliest, the deadline), and the healthy sink after
    them was neither flushed nor closed."""
    sinks, faults, took = _close_with(monkeypatch, ["flush"] * 3 + [None], hung_s=5.0, timeout=None)
    assert sinks[3].calls == ["flush", "close"], sinks[3].calls
    assert dict(faults.counts) == {"exporter _StuckSink hung": 3}
    assert took < 3 * (5.0 + 5.0 / 4) + 10, took
