"""cc_distribution on collectives of unusual dtypes (2 gloo ranks, one launch):

- complex payloads (all_reduce, all_gather) cannot be read by the engine: no comm row (not a tensorless
  float32 row of norm 0), one fault per call, said once; a barrier keeps its tensorless `calls` row;
- bool all_reduce(SUM) is a logical OR in torch and int8 SUM wraps: no AnomalyComm (the int8 key, whose
  sum can leave int8's range, is counted as unchecked); their rows hold the statistics of the results;
- an int32 SUM within range corrupted below the monitor (a broken library's all_reduce, as in
  test_comm_checks) is still flagged, at that step and rank only.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

STEPS, TAMPER_STEP, TAMPER_RANK = 2, 1, 1
COMPLEX_FAULT = "unreadable tensor (complex tensor) in a collective"


def _complex_ops(rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    dist.all_reduce(c)
    parts = [torch.zeros(2, dtype=torch.complex64) for _ in range(2)]
    dist.all_gather(parts, c)
    return c, parts


def _bool_sum(rank: int) -> torch.Tensor:
    b = torch.tensor([True, False, True, True]) if rank == 0 else torch.tensor([True, True, False, True])
    dist.all_reduce(b)
    return b


def _int8_sum() -> torch.Tensor:
    i8 = torch.tensor([100, -5, 7], dtype=torch.int8)  # 100 + 100 wraps in int8
    dist.all_reduce(i8)
    return i8


def _int32_sum(rank: int) -> torch.Tensor:
    i32 = torch.tensor([1000, -7, 123456], dtype=torch.int32) * (rank + 1)
    dist.all_reduce(i32)
    return i32


def _rank(rank: int, world_size: int, out_root: str) -> dict:
    from trainermon import TrainerMon
    from trainermon.runtime.probes.comm import CommProbe

    state = {"step": 0, "armed": False}
    real = dist.all_reduce

    def corrupting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        out = real(tensor, op=op, group=group, async_op=async_op)
        if state["armed"] and state["step"] == TAMPER_STEP and dist.get_rank() == TAMPER_RANK:
            tensor[0] += 1
        return out

    dist.all_reduce = corrupting  # under the monitor's wrapper, as a broken library would sit
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Capture()
    logging.getLogger("trainermon").addHandler(handler)
    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"ops": ["norm", "min", "max"], "ndigits": 12, "cc_distribution": {"enable": True}}, fh)
    try:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        results = []
        for step in range(STEPS):
            state["step"] = step
            model(torch.ones(1, 2)).sum().backward()
            c, parts = _complex_ops(rank)
            b = _bool_sum(rank)
            i8 = _int8_sum()
            state["armed"] = True
            i32 = _int32_sum(rank)
            state["armed"] = False
            dist.barrier()
            # plain lists: tensors would travel back through shared memory the rank's exit frees
            results.append({"c": c.tolist(), "parts": [p.tolist() for p in parts], "b": b.tolist()})
            results[-1].update(i8=i8.tolist(), i32=i32.tolist(), dtypes=[str(t.dtype) for t in (b, i8, i32)])
            opt.step()
            opt.zero_grad()
        probe = next(p for p in monitor.loop.probes if isinstance(p, CommProbe))
        violations = [(s, v.key.op, v.key.redop, v.stat, v.ranks, v.key.site) for s, v in probe.violations]
        faults = dict(monitor.faults.counts)
        unchecked = probe.unchecked
        run_dir = monitor.loop.outputs.run_dir
        monitor.close()
    finally:
        dist.all_reduce = real
        logging.getLogger("trainermon").removeHandler(handler)
    return {
        "violations": violations,
        "faults": faults,
        "unchecked": unchecked,
        "rows": read_family(run_dir, "comm"),
        "messages": messages,
        "results": results,
    }


def _norm(values: list) -> float:
    return math.sqrt(sum(float(v) ** 2 for v in values))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """The one launch both tests read."""
    return run_ranks(_rank, world_size=2, out_root=str(tmp_path_factory.mktemp("odd_dtypes")))


def _rows(res: dict) -> dict:
    """Comm rows keyed by (calling function, name without the site, step)."""
    rows = {}
    for row in res["rows"]:
        fn = row["name"].rsplit("(", 1)[-1].rstrip(")")
        rows[(fn, row["name"].split("@")[0], int(row["step"]))] = row
    return rows


def test_complex_payload_has_no_row_and_is_a_fault(ranks):
    for res in ranks:
        for r in res["results"]:  # torch's own result (the monitor changes nothing)
            assert r["c"] == [3 + 6j, 9 - 3j] and r["parts"] == [[3 + 6j, 9 - 3j]] * 2
        rows = _rows(res)
        # no row (not a tensorless float32 row of norm 0), one fault per call (2 calls x 2 steps), said once
        assert not [k for k in rows if k[0] == "_complex_ops"], sorted(rows)
        assert res["faults"].get(COMPLEX_FAULT) == 2 * STEPS, res["faults"]
        said = [m for m in res["messages"] if COMPLEX_FAULT in m]
        assert len(said) == 1 and "all_reduce/world@" in said[0] and "_complex_ops" in said[0], said
        for step in range(STEPS):  # a real tensorless call keeps its row
            barrier = rows[("_rank", "barrier/world/calls", step)]
            assert barrier["calls"] == "1" and float(barrier["norm"]) == 0.0


def test_bool_or_and_int8_wrap_pass_corrupted_int32_caught(ranks):
    inputs_b = [[True, False, True, True], [True, True, False, True]]
    for rank, res in enumerate(ranks):
        # torch's own results: OR for bool, wrapped int8, exact int32 (corrupted at one step and rank)
        for step, r in enumerate(res["results"]):
            assert r["b"] == [x or y for x, y in zip(*inputs_b)]
            assert r["i8"] == [-56, -10, 14]
            want32 = [3000, -21, 370368]
            if step == TAMPER_STEP and rank == TAMPER_RANK:
                want32[0] += 1
            assert r["i32"] == want32
        rows = _rows(res)
        for step in range(STEPS):  # the rows: the statistics of the results, from the values here
            r = res["results"][step]
            names = ("_bool_sum", "_int8_sum", "_int32_sum")
            for fn, t, dtype in zip(names, (r["b"], r["i8"], r["i32"]), r["dtypes"]):
                row = rows[(fn, "all_reduce/world/output", step)]
                values = [float(v) for v in t]
                assert math.isclose(float(row["norm"]), _norm(t), rel_tol=1e-9), (fn, row)
                assert float(row["min"]) == min(values) and float(row["max"]) == max(values), (fn, row)
                assert row["dtype"] == dtype, row
        # no false alarm for the bool OR or the int8 wrap; the corrupted int32 sum caught at its step, rank
        expected = []
        if rank == TAMPER_RANK:
            expected = [(TAMPER_STEP, "all_reduce", "sum", "sum", (rank,))]
        assert [v[:5] for v in res["violations"]] == expected, res["violations"]
        assert all(v[5].endswith("(_int32_sum)") for v in res["violations"])
        # the int8 key may wrap: unchecked at each step
        assert res["unchecked"] == STEPS, res["unchecked"]
