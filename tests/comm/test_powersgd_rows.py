"""`cc_distribution` under DDP's PowerSGD hook (and the fp16 hook and no hook as controls), 2 gloo ranks.

PowerSGD issues its P and Q all-reduces from Future callbacks, on gloo's thread or the training thread,
and waits on each with `get_future().wait()`, then changes the output in place (`_orthogonalize`,
`div_(world_size)`). Two faults made the rows differ by rank and step: the monitor read an async
all-reduce's output in a completion callback, which a torch Future runs only after it has woken its
waiters (so it could read the output after the hook had changed it: the Q row was half the all-reduce's
result, and the checks raised false AnomalyComm); and a call made on gloo's thread while the training
thread was in the monitor's own code was dropped as the monitor's own. Reference: the test's own
all_reduce under the monitor's wrapper keeps a float64 copy of every call's input on every rank; each
output row's norm must be that of the sum over ranks (the all-reduce's result). The "late" run forces the
third order, which struck CI about once in five runs: the body's all-reduce completes after the monitor
chained its callback but before PowerSGD chains its `div_`, which then runs at once on the training
thread while the monitor's callback (made slow here) is still to read the output on gloo's."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

OPS = ["norm", "mean", "min", "max"]
STEPS = 5
RUNS = (("none", 0), ("fp16", 0), ("powersgd", 0), ("powersgd", 1), ("powersgd", 2), ("late", 0))
CALLBACKS = ("unpack_uncompressed_tensors_and_allreduce_ps", "compute_qs")  # PowerSGD's P and Q


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _kind(frame) -> str | None:
    """Which call of the hook this is: P, Q (PowerSGD's callbacks) or the hook's body (None: not DDP's, as
    the monitor's own check table)."""
    while frame is not None:
        if "ddp_comm_hooks" in frame.f_code.co_filename:
            name = frame.f_code.co_name
            return name if name in CALLBACKS else "body"
        frame = frame.f_back
    return None


class _CompletesBeforeSecondChain:
    """A work whose future, asked for a second time (by PowerSGD, after the monitor), has completed first:
    PowerSGD's callback then runs at once on the training thread."""

    def __init__(self, work) -> None:
        self.work, self.asked = work, 0

    def get_future(self):
        self.asked += 1
        future = self.work.get_future()
        if self.asked > 1:
            while not future.done():
                time.sleep(0.001)
        return future

    def wait(self, *args):
        return self.work.wait(*args)


def _recording(real, state: dict):
    """torch's all_reduce, keeping a float64 copy of each input (on whichever thread calls it; as a list:
    tensors would go back to the test process through shared memory that ends with the rank)."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        kind = _kind(sys._getframe(1))
        if kind is not None:
            state["inputs"].append((state["step"], kind, tensor.detach().double().flatten().tolist()))
        if op is None:
            work = real(tensor, group=group, async_op=async_op)
        else:
            work = real(tensor, op=op, group=group, async_op=async_op)
        return _CompletesBeforeSecondChain(work) if state["late"] and kind == "body" and async_op else work

    return all_reduce


def _slow_off_main_thread(finish):
    """The monitor's read of a call's outputs, made slow when it runs on another thread (gloo's)."""

    def slow(self, call):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        return finish(self, call)

    return slow


def _job(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon
    from trainermon.comm.recorder import CommRecorder

    res = {}
    real, finish = dist.all_reduce, CommRecorder._finish
    state: dict = {"step": -1, "inputs": [], "late": False}
    dist.all_reduce = _recording(real, state)  # under the monitor's wrapper: it wraps what it finds
    try:
        for hook, run in RUNS:
            tag = f"{hook}{run}"
            state["late"] = hook == "late"
            CommRecorder._finish = _slow_off_main_thread(finish) if state["late"] else finish
            os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, tag)
            cfg = os.path.join(out, f"{tag}-{rank}.json")
            with open(cfg, "w") as fh:
                json.dump({"cc_distribution": {"enable": True}, "ops": OPS, "ndigits": 12}, fh)
            torch.manual_seed(run)
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
            ddp = DDP(model, bucket_cap_mb=25)  # one bucket
            if hook == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif hook in ("powersgd", "late"):
                psgd = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
                ddp.register_comm_hook(psgd, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            mon = TrainerMon(cfg)
            mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
            state["inputs"] = []
            for step in range(STEPS):
                state["step"] = step
                ddp(_x(rank, step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            probe = next(p for p in mon.loop.probes if type(p).__name__ == "CommProbe")
            mon.close()
            res[tag] = {
                "rows": read_family(mon.run_dir, "comm"),
                "inputs": list(state["inputs"]),
                "violations": [str(v) for _, v in probe.violations],
            }
    finally:
        dist.all_reduce, CommRecorder._finish = real, finish
    return res


def _from_thread(t: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)  # the job's: made on another thread while the training thread is in monitor code


def _own(t: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)  # the training thread inside the monitor's code: the monitor's own, no row


def _threads(rank: int, out: str) -> dict:
    """A collective made on another thread while the training thread is inside the monitor's own code is
    the job's (it used to be dropped: the monitor's code was a global flag, not the calling thread's)."""
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, "threads")
    cfg = os.path.join(out, f"threads-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"cc_distribution": {"enable": True}, "ops": OPS, "ndigits": 12}, fh)
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(3):
        model(_x(rank, step)).pow(2).mean().backward()
        with mon.loop.clock:
            worker = threading.Thread(target=_from_thread, args=(_x(rank, step),))
            worker.start()
            worker.join()
            _own(_x(rank, step))
        opt.step()
        opt.zero_grad()
    mon.close()
    return {"rows": read_family(mon.run_dir, "comm")}


def _row_kind(name: str) -> str:
    site = name.split("@", 1)[1]
    return next((c for c in CALLBACKS if site.endswith(f"({c})")), "body")


def test_powersgd_comm_rows_agree_across_ranks_and_match_the_sum(tmp_path):
    results = run_ranks(_job, world_size=2, timeout=400, out=str(tmp_path))
    for hook, run in RUNS:
        tag = f"{hook}{run}"
        by_rank = [r[tag] for r in results]
        # the float64 all-reduce result of each call: the sum of both ranks' inputs, call by call
        calls: dict[tuple[int, str], list[list[torch.Tensor]]] = {}
        for got in by_rank:
            per: dict[tuple[int, str], list[torch.Tensor]] = {}
            for step, kind, values in got["inputs"]:
                per.setdefault((step, kind), []).append(torch.tensor(values, dtype=torch.float64))
            for key, tensors in per.items():
                calls.setdefault(key, []).append(tensors)
        want = {}
        for key, ranks in calls.items():
            assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1]), (tag, key)
            want[key] = math.sqrt(sum(float((a + b).norm()) ** 2 for a, b in zip(*ranks)))
        psgd = hook in ("powersgd", "late")
        kinds = {"body"} | (set(CALLBACKS) if psgd else set())
        for step in range(STEPS):  # PowerSGD compresses from its iteration 2: P and Q from then on
            expected = {"body"} | (set(CALLBACKS) if psgd and step >= 2 else set())
            assert {k for s, k in want if s == step} == expected, (tag, step, sorted(want))
        names = []
        for rank, got in enumerate(by_rank):
            outputs = [r for r in got["rows"] if "/output@" in r["name"]]
            names.append(sorted((int(r["step"]), r["name"]) for r in got["rows"]))
            seen = {(int(r["step"]), _row_kind(r["name"])) for r in outputs}
            assert seen == set(want), (tag, rank, sorted(seen ^ set(want)))
            for r in outputs:
                key = (int(r["step"]), _row_kind(r["name"]))
                assert key[1] in kinds, (tag, rank, r["name"])
                tol = 2e-3 if hook == "fp16" else 1e-5  # fp16: the all-reduce sums rounded halves
                norm = float(r["norm"])
                assert abs(norm - want[key]) <= tol * want[key], (tag, rank, key, norm, want[key])
            assert got["violations"] == [], (tag, rank, got["violations"])  # no AnomalyComm
        assert names[0] == names[1], (tag, sorted(set(names[0]) ^ set(names[1])))  # same rows, every step


def test_call_on_another_thread_during_monitor_code_is_the_jobs(tmp_path):
    by_rank = [r["threads"] for r in run_ranks(_threads_only, world_size=2, timeout=200, out=str(tmp_path))]
    for rank, got in enumerate(by_rank):
        outputs = {int(r["step"]): r for r in got["rows"] if "/output@" in r["name"]}
        assert all("(_own)" not in r["name"] for r in got["rows"]), (rank, got["rows"])
        assert sorted(outputs) == [0, 1, 2], (rank, got["rows"])
        for step, row in outputs.items():
            assert row["name"].endswith("(_from_thread)"), row["name"]
            want = float((_x(0, step).double() + _x(1, step).double()).norm())
            assert abs(float(row["norm"]) - want) <= 1e-5 * want, (rank, step, row["norm"], want)


def _threads_only(rank: int, world: int, out: str) -> dict:
    return {"threads": _threads(rank, out)}


def _two_groups(rank: int, world: int, out: str) -> dict:
    """Async all-reduces on two groups, issued in opposite orders on the two ranks, then waited: legal on
    gloo (a worker per group). The monitor must not make them blocking (that deadlocked)."""
    import torch.distributed as dist

    from trainermon import TrainerMon

    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, "groups")
    cfg = os.path.join(out, f"groups{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"cc_distribution": {"enable": True}, "ops": ["norm"], "write_interval_s": 0}, fh)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    sums = []
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        a, b = torch.full((4,), 1.0 + rank), torch.full((4,), 10.0 + rank)
        order = [(a, g1), (b, g2)] if rank == 0 else [(b, g2), (a, g1)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
        for work in works:
            work.wait()
        sums.append((a[0].item(), b[0].item()))
        opt.step()
        opt.zero_grad()
    monitor.close()
    outputs = [r for r in read_family(monitor.run_dir, "comm") if "/output@" in r["name"]]
    return {"sums": sums, "outputs": sorted(float(r["norm"]) for r in outputs if int(r["step"]) == 1)}


def test_async_calls_on_two_groups_in_opposite_orders_finish(tmp_path):
    for res in run_ranks(_two_groups, world_size=2, timeout=120, out=str(tmp_path)):
        assert res["sums"] == [(3.0, 21.0), (3.0, 21.0)]
        # one row: both groups span ranks 0-1 (named alike) and the calls share a line: summed
        want = math.sqrt(4 * 3.0**2 + 4 * 21.0**2)
        got = res["outputs"]
        assert len(got) == 1 and abs(got[0] - want) <= 1e-6 * want, (got, want)
