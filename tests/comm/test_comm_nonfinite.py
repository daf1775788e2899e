"""cc_distribution's invariant checks and NaN/Inf, on 2 gloo ranks (one launch), through DDP's gradient
all-reduce (the monitor's delegating comm hook runs it through torch.distributed.all_reduce):

- a NaN or Inf in one rank's gradient spreads through the all-reduce: the collective is correct, so no
  AnomalyComm; the key is counted as unchecked at that step only, said once in the log, and the finite
  steps after it are checked as before;
- a finite input whose all-reduce output a broken library corrupts (a constant added on one rank) is
  still a violation, on that rank only;
- a finite input whose output comes back with a NaN is a violation (`nonfinite`), on that rank only.

The faults replace torch.distributed.all_reduce before the monitor patches it, the way a broken
communication library would sit under it (as in test_comm_checks). Both with `nans`/`infs` in `ops`
(statistics over finite values, NaN/Inf counted) and without (NaN/Inf in the statistics themselves)."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks

BAD_RANK = 1
# step -> (what rank BAD_RANK does), the other rank's inputs and outputs stay finite
INF_IN, NAN_IN, ADD_OUT, NAN_OUT = "inf_in", "nan_in", "add_out", "nan_out"
SCHEDULE = {1: INF_IN, 2: NAN_IN, 4: ADD_OUT, 5: NAN_OUT}  # steps 0, 3, 6 clean
STEPS = 7
SHORT = {1: INF_IN, 2: NAN_IN, 3: NAN_OUT}  # the run without nans/infs in ops (steps 0, 4 clean)


def _faulty_all_reduce(real, state):
    """all_reduce as a broken library might do it, on BAD_RANK while `state["out"]` names a fault."""

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = real(tensor, op=op, group=group, async_op=async_op)
        fault = state["out"]
        if fault and dist.get_rank() == BAD_RANK:
            if work is not None:
                work.wait()  # the result is in: corrupt it before anyone reads it
            flat = tensor.view(-1)
            if fault == ADD_OUT:
                flat[1] += 1.0
            else:
                flat[1] = float("nan")
        return work

    return all_reduce


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, out_root: str, tag: str, ops: list[str], schedule: dict, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"ops": ops, "alert": {"dump": True}, "cc_distribution": {"enable": True}}, fh)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"out": None}
    real = dist.all_reduce
    dist.all_reduce = _faulty_all_reduce(real, state)  # under the monitor's patch: before it exists
    log = _Lines()
    logging.getLogger("trainermon").addHandler(log)
    unchecked = []
    try:
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        probe = next(p for p in monitor.loop.probes if type(p).__name__ == "CommProbe")
        g = torch.Generator().manual_seed(10 + rank)
        for step in range(steps):
            x = torch.randn(3, 4, generator=g)
            fault = schedule.get(step) if rank == BAD_RANK else None
            if fault == INF_IN:
                x[0, 0] = float("inf")  # the weight's gradient gets +Inf, the bias's stays finite
            elif fault == NAN_IN:
                x[0, 0] = float("nan")
            state["out"] = fault if fault in (ADD_OUT, NAN_OUT) else None
            model(x).sum().backward()  # DDP's hook runs the (faulty) all_reduce
            state["out"] = None
            for p in model.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)  # the weights stay finite for the next steps
            opt.step()
            opt.zero_grad()
            unchecked.append(probe.unchecked)
        found = [(s, v.key.op, v.stat, v.ranks) for s, v in probe.violations]
        monitor.close()
    finally:
        dist.all_reduce = real
        logging.getLogger("trainermon").removeHandler(log)
    path = os.path.join(out_root, tag, "anomaly_detected", f"anomaly_rank{rank}.jsonl")
    anomalies = []
    if os.path.exists(path):
        with open(path) as fh:
            anomalies = [json.loads(line) for line in fh if '"AnomalyComm"' in line]
    said = [line for line in log.lines if "NaN or Inf" in line]
    return {"found": found, "unchecked": unchecked, "anomalies": anomalies, "said": said}


def _rank(rank: int, world: int, out_root: str) -> dict:
    return {
        "counted": _train(rank, out_root, "counted", ["norm", "max", "nans", "infs"], SCHEDULE, STEPS),
        "plain": _train(rank, out_root, "plain", ["norm", "max"], SHORT, 5),
    }


def _expect(res: dict, rank: int, schedule: dict, steps: int, said: int) -> None:
    # no violation where an input was NaN/Inf (the all-reduce spread it: correct)
    skipped = {s for s, f in schedule.items() if f in (INF_IN, NAN_IN)}
    assert not [v for v in res["found"] if v[0] in skipped], res["found"]
    # violations: the corrupted outputs, on the corrupted rank only
    want = []
    if rank == BAD_RANK:
        stat = {ADD_OUT: "sum", NAN_OUT: "nonfinite"}
        want = [(s, "all_reduce", stat[f], (rank,)) for s, f in sorted(schedule.items()) if f in stat]
    assert res["found"] == want, res["found"]
    assert sorted(a["step"] for a in res["anomalies"]) == [s for s, *_ in want], res["anomalies"]
    # one key a step (the single DDP bucket); unchecked at the NaN/Inf-input steps only, checked after
    added = [b - a for a, b in zip([0, *res["unchecked"]], res["unchecked"])]
    assert added == [int(s in skipped) for s in range(steps)], res["unchecked"]
    assert len(res["said"]) == said, res["said"]  # once a process, though two steps were skipped


def test_nonfinite_skipped_corruption_still_flagged(tmp_path):
    results = run_ranks(_rank, world_size=2, out_root=str(tmp_path))
    for rank, res in enumerate(results):
        _expect(res["counted"], rank, SCHEDULE, STEPS, said=1)
        # no nans/infs in ops: NaN/Inf reach the statistics themselves; the same outcome
        _expect(res["plain"], rank, SHORT, 5, said=0)


def _row(total: float, low: float, high: float, infs: int = 0) -> torch.Tensor:
    from trainermon.stats.partials import INFS, MAX, MIN, SUM, SUMSQ, empty_partials

    row = empty_partials(1)
    row[0, SUM], row[0, MIN], row[0, MAX], row[0, INFS] = total, low, high, infs
    row[0, SUMSQ] = high * high
    return row


def test_inf_out_of_finite_in_overflow_is_unchecked_not_a_violation():
    """The table without ranks: an Inf from finite float16 inputs whose sum may overflow is unchecked; the
    same Inf where no sum of the inputs reaches the dtype's range is a violation."""
    from trainermon.comm.checks import CheckEntry, CheckKey, evaluate, pack

    key = CheckKey("reduce", "all_reduce", "sum", "world", (0, 1), "site", None)
    for big, expect in ((40000.0, ([], 1)), (1.0, (["nonfinite"], 0))):
        entries = {
            r: [(key, CheckEntry(torch.float16, _row(big, 0.0, big), _row(0.0, 0.0, 0.0, 1), 1, 1))]
            for r in (0, 1)
        }
        table = sum(pack(entries[r], r, 2, torch.device("cpu")) for r in (0, 1)).numpy()
        found, unchecked = evaluate(table, entries[0], 0)
        assert ([v.stat for v in found], unchecked) == expect
