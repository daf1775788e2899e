"""cc_distribution on 4 gloo ranks (one launch): the invariant checks catch three faults injected below
the monitor (a reduction over the wrong group, a double division, one rank's output silently corrupted),
each at the right op, step and rank, and stay silent on the correct collectives around them;
cc_codeline keeps only matching call sites; cc_log_only lists call sites and training goes on.

The faults replace torch.distributed.all_reduce before the monitor patches it, the way a broken
communication library would sit under it: the monitor sees the call the program made (its group, its
reduction), the fault changes what the call does."""

from __future__ import annotations

import csv
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

WRONG_GROUP, DOUBLE_DIV, CORRUPT = 1, 2, 3  # the step each fault is injected at
CORRUPT_RANK = 2


def _faulty_all_reduce(real, pairs, state):
    """all_reduce as a broken library might do it; `state["step"]` says which fault is on."""

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        step = state["step"]
        if op == dist.ReduceOp.AVG:  # gloo has no AVG: a sum, then the division (twice at DOUBLE_DIV)
            real(tensor, group=group)
            tensor /= dist.get_world_size(group)
            if step == DOUBLE_DIV:
                tensor /= dist.get_world_size(group)
            return None
        if step == WRONG_GROUP and group is None and state["armed"]:
            return real(tensor, op=op, group=pairs, async_op=async_op)  # {0,1} and {2,3}, not the world
        out = real(tensor, op=op, group=group, async_op=async_op)
        if step == CORRUPT and dist.get_rank() == CORRUPT_RANK and state["armed"]:
            tensor[0] += 1.0
        return out

    return all_reduce


def data(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, generator=g) * 10


def _codeline_target(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def _train(monitor_cfg: dict, rank: int, out_root: str, tag: str, steps: int, state: dict | None = None):
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(monitor_cfg, fh)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(steps):
        if state is not None:
            state["step"] = step
        model(torch.ones(2, 4)).sum().backward()
        t = data(rank, step)
        if state is not None:
            state["armed"] = True
        dist.all_reduce(t)  # the faulty call site for WRONG_GROUP and CORRUPT
        if state is not None:
            state["armed"] = False
        dist.all_reduce(data(rank, step), op=dist.ReduceOp.AVG)  # DOUBLE_DIV's site
        dist.all_reduce(data(rank, step), op=dist.ReduceOp.MAX)
        dist.broadcast(data(rank, step), src=3)
        parts = [torch.zeros(64) for _ in range(4)]
        dist.all_gather(parts, data(rank, step))
        dist.reduce_scatter_tensor(torch.zeros(16), data(rank, step))
        _codeline_target(data(rank, step))
        opt.step()
        opt.zero_grad()
    probe = monitor.loop.probes[-1]
    found = [(s, v.key.op, v.key.redop, v.stat, v.ranks, v.key.site) for s, v in probe.violations]
    run_dir = monitor.loop.outputs.run_dir
    monitor.close()
    return found, run_dir, probe.unchecked


def _checks_rank(rank: int, world: int, out_root: str) -> dict:
    pairs, _ = dist.new_subgroups(group_size=2)
    state = {"step": 0, "armed": False}
    real = dist.all_reduce
    dist.all_reduce = _faulty_all_reduce(real, pairs, state)
    try:
        base = {"ops": ["norm", "mean", "min", "max"], "alert": {"dump": True}}
        found, run_dir, unchecked = _train(
            {**base, "cc_distribution": {"enable": True}}, rank, out_root, "faults", 5, state
        )
    finally:
        dist.all_reduce = real
    anomalies = []
    path = os.path.join(out_root, "faults", "anomaly_detected", f"anomaly_rank{rank}.jsonl")
    if os.path.exists(path):
        with open(path) as fh:
            anomalies = [json.loads(line) for line in fh if '"AnomalyComm"' in line]
    # cc_codeline: only the call site inside _codeline_target
    _, code_dir, _ = _train(
        {
            **base,
            "cc_distribution": {
                "enable": True,
                "cc_codeline": [r"test_comm_checks\.py:\d+\(_codeline_target\)"],
            },
        },
        rank,
        out_root,
        "codeline",
        2,
    )
    # cc_log_only: call sites listed, no statistics, training goes on to the last step
    _, log_dir, _ = _train(
        {**base, "cc_distribution": {"enable": True, "cc_log_only": True}}, rank, out_root, "logonly", 3
    )
    with open(os.path.join(log_dir, "comm_call_sites.csv")) as fh:
        sites = list(csv.DictReader(fh))
    return {
        "found": found,
        "anomalies": anomalies,
        "unchecked": unchecked,
        "codeline_rows": [r["name"] for r in read_family(code_dir, "comm")],
        "log_rows": read_family(log_dir, "comm"),
        "sites": sites,
        "fault_rows": read_family(run_dir, "comm"),
    }


def test_faults_flagged_at_op_step_rank_and_filters(tmp_path):
    results = run_ranks(_checks_rank, world_size=4, out_root=str(tmp_path))
    for rank, res in enumerate(results):
        found = res["found"]
        assert res["unchecked"] == 0
        by_step = {}
        for step, op, redop, stat, ranks, site in found:
            by_step.setdefault(step, []).append((op, redop, stat, ranks, site))
        assert set(by_step) <= {WRONG_GROUP, DOUBLE_DIV, CORRUPT}, found  # nothing at clean steps 0, 4
        # 1. the world all_reduce reduced over pairs: every rank's output misses the other pair's inputs
        assert [(op, redop, ranks) for op, redop, _, ranks, _ in by_step[WRONG_GROUP]] == [
            ("all_reduce", "sum", (rank,))
        ], by_step
        # 2. AVG divided twice: every rank flagged, at the AVG call only
        assert [(op, redop, ranks) for op, redop, _, ranks, _ in by_step[DOUBLE_DIV]] == [
            ("all_reduce", "avg", (rank,))
        ], by_step
        # 3. corruption on one rank: that rank only
        if rank == CORRUPT_RANK:
            assert [(op, redop, ranks) for op, redop, _, ranks, _ in by_step[CORRUPT]] == [
                ("all_reduce", "sum", (rank,))
            ], by_step
        else:
            assert CORRUPT not in by_step, by_step
        # the same call site for faults 1 and 3 (the armed line), a different one for 2
        assert by_step[WRONG_GROUP][0][4] != by_step[DOUBLE_DIV][0][4]
        # the records: AnomalyComm, the step, op and group in the name, the rank
        steps = sorted(a["step"] for a in res["anomalies"])
        assert steps == sorted(s for s, *_ in found)
        assert all(
            a["family"] == "comm" and a["name"].startswith("all_reduce/world@") for a in res["anomalies"]
        )
        assert all(a["ranks"] == [rank] for a in res["anomalies"])
        # statistics rows exist for every op of the step, and the checks cost no row
        names = {r["name"].split("@")[0] for r in res["fault_rows"] if r["step"] == "0"}
        assert names == {
            "all_reduce/world/output",
            "broadcast/world/output",
            "all_gather/world/output",
            "reduce_scatter_tensor/world/output",
        }, names
        # cc_codeline
        assert res["codeline_rows"] and all("_codeline_target" in n for n in res["codeline_rows"])
        # cc_log_only
        assert res["log_rows"] == []
        ops = {s["op"] for s in res["sites"]}
        assert ops == {"all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor"}, ops
        assert all(int(s["calls"]) >= 1 and "test_comm_checks.py" in s["site"] for s in res["sites"])
