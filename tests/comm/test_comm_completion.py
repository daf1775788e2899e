"""A collective's completion callback still running on gloo's thread when the step ends is waited for, not
lost (2 real gloo ranks, one launch); a completed call's future (and its outputs) is not kept.

The race this pins down, as DDP's default hook runs into it: a torch Future that completes wakes its
waiters first and hands its callbacks to the backend's thread after; a callback added in between runs at
once on the adding thread. DDP adds its `.then` right after the all-reduce returns, so in that window the
backward can finish, and the step end take its sums, while the monitor's read of the all-reduce's output
still waits on gloo's thread: the output was dropped and the invariant check saw inputs without outputs
(a flaky `AnomalyComm` in test_comm_frameworks). Here the window is made wide and certain: the peer joins
the all-reduce late (so the monitor's callback is added before completion and runs on gloo's thread), the
monitor's statistics are slowed down on any thread but the training thread (the only injection), and the
training thread waits on the future itself and then adds DDP's kind of callback, which runs at once."""

from __future__ import annotations

import threading
import time

import torch

from tests.distributed import run_ranks

SLOW_S = 0.5  # the monitor's read on gloo's thread: far longer than the training thread needs to reach take()


def _race(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from trainermon.comm.recorder import CommRecorder
    from trainermon.comm.spec import all_specs
    from trainermon.config.schema import CommConfig
    from trainermon.stats.engine import EngineOptions, StatsEngine
    from trainermon.stats.partials import SUM

    engine, lock, faults = StatsEngine(EngineOptions()), threading.Lock(), []
    main = threading.current_thread()

    def compute(tensors):
        if threading.current_thread() is not main:
            time.sleep(SLOW_S)
        with lock:
            return engine.compute_rows(tensors)

    recorder = CommRecorder(compute, lambda where, exc: faults.append(f"{where}: {exc!r}"), rank, lock)
    recorder.configure(CommConfig(enable=True))
    recorder.on = True
    spec = next(s for s in all_specs() if s.name == "all_reduce")
    tensor = torch.arange(1.0, 9.0) * (rank + 1)
    if rank == 1:
        time.sleep(1.0)  # rank 0's monitor callback is added well before the all-reduce can complete
    call = recorder.before(spec, (tensor,), {"async_op": True})
    work = dist.all_reduce(tensor, async_op=True)
    recorder.after(call, work)
    future = work.get_future()
    future.wait()  # returns once completed: the callbacks may not have run yet
    ddp_like = future.then(lambda f: f.value()[0])  # added after completion: runs at once, here
    ddp_like.wait()
    late = recorder.settle()
    metas, parts, checks = recorder.take()
    outputs = [float(p[0, SUM]) for m, p in zip(metas, parts) if "/output@" in m.name]
    (key, entry), *_ = checks
    # A completed call leaves nothing behind before the step's end: its future holds its output tensors.
    recorder.compute = lambda tensors: engine.compute_rows(tensors)  # no slow reads from here on
    for _ in range(5):
        big = torch.ones(1 << 16)
        call = recorder.before(spec, (big,), {"async_op": True})
        work = dist.all_reduce(big, async_op=True)
        recorder.after(call, work)
        work.wait()
    deadline = time.monotonic() + 30
    while recorder.inflight and time.monotonic() < deadline:
        time.sleep(0.01)  # a callback may still be finishing on gloo's thread
    held = len(recorder.inflight)
    dist.barrier()
    return {
        "held": held,
        "late": late,
        "outputs": outputs,
        "check_out": None if entry.out_row is None else float(entry.out_row[0, SUM]),
        "want": float(tensor.sum()),
        "faults": faults,
    }


def test_completion_callback_on_the_backend_thread_is_waited_for():
    results = run_ranks(_race, world_size=2, timeout=120)
    want = float(sum((torch.arange(1.0, 9.0) * (r + 1)).sum() for r in range(2)))
    for rank, got in enumerate(results):
        assert got["want"] == want, rank  # the all-reduce itself
        assert got["faults"] == [], rank
        assert got["late"] == 0, rank
        assert got["outputs"] == [want], (rank, got)  # the output's sum, in this step's rows
        assert got["check_out"] == want, (rank, got)  # and in the invariant check's line
        assert got["held"] == 0, rank
