"""cc_distribution on real gloo collectives (2 ranks, one launch): every watched op with known tensors,
statistics against references computed here from the same known tensors, calls and bytes, inputs with
cc_pre_hook, async ops (rows when the work completes), functional collectives, patches present on
collected steps only and gone after close(), the invariant checks silent on correct collectives, and a
cc_codeline that matches nothing warned about once."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 4  # steps 0 and 2 collected (step_interval 2)


def known(rank: int, step: int, n: int = 6, salt: float = 0.0) -> torch.Tensor:
    """The tensor rank `rank` feeds a collective at `step`: known to every rank (references)."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) - 2.0 + 0.5 * step + salt


def _collectives(rank: int, world: int, step: int) -> None:
    """One call of each op, each from its own line."""
    t = known(rank, step)
    dist.all_reduce(t)
    a = known(rank, step, salt=1.0)
    work = dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    b = known(rank, step, salt=2.0)
    dist.broadcast(b, src=1)
    gathered = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(gathered, known(rank, step, salt=3.0))
    flat = torch.zeros(6 * world)
    dist.all_gather_into_tensor(flat, known(rank, step, salt=4.0))
    piece = torch.zeros(3)
    dist.reduce_scatter_tensor(piece, known(rank, step, n=3 * world, salt=5.0))
    swapped = torch.zeros(2 * world)
    dist.all_to_all_single(swapped, known(rank, step, n=2 * world, salt=6.0))
    r = known(rank, step, salt=7.0)
    dist.reduce(r, dst=0)
    if rank == 0:
        dist.send(known(0, step, salt=8.0), dst=1)
        dist.isend(known(0, step, salt=9.0), dst=1).wait()
    else:
        got = torch.zeros(6)
        dist.recv(got, src=0)
        got2 = torch.zeros(6)
        dist.irecv(got2, src=0).wait()
    ops = [
        dist.P2POp(dist.isend, known(rank, step, salt=10.0), 1 - rank),
        dist.P2POp(dist.irecv, torch.zeros(6), 1 - rank),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()
    f = funcol.all_reduce(known(rank, step, salt=11.0), "sum", dist.group.WORLD)
    f = f + 0  # wait (AsyncCollectiveTensor)


def _second_micro(step: int) -> None:
    dist.all_reduce(torch.full((3,), float(step + 1)))


def _expected(world: int, step: int) -> dict[str, torch.Tensor]:
    """What each op's rows hold, from the known tensors (rank 0's view, and rank 1's where it differs)."""
    ranks = range(world)
    k = lambda r, **kw: known(r, step, **kw)  # noqa: E731
    return {
        "all_reduce/world/output": sum(k(r) for r in ranks),
        "all_reduce/world/input": k(0),
        "all_reduce_max/world/output": torch.stack([k(r, salt=1.0) for r in ranks]).max(0).values,
        "broadcast/world/output": k(1, salt=2.0),
        "all_gather/world/output": torch.cat([k(r, salt=3.0) for r in ranks]),
        "all_gather_into_tensor/world/output": torch.cat([k(r, salt=4.0) for r in ranks]),
        "reduce_scatter_tensor/world/output": sum(k(r, n=3 * world, salt=5.0) for r in ranks)[:3],
        "all_to_all_single/world/output": torch.cat([k(r, n=2 * world, salt=6.0)[0:2] for r in ranks]),
        "reduce/world/output": sum(k(r, salt=7.0) for r in ranks),
        "send/world/input": k(0, salt=8.0),
        "isend/world/input": k(0, salt=9.0),
        "batch_isend/world/input": k(0, salt=10.0),
        "batch_irecv/world/output": k(1, salt=10.0),
        "funcol.all_reduce/world/output": sum(k(r, salt=11.0) for r in ranks),
    }


def _ops_rank(rank: int, world: int, out_root: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "ops")
    cfg = os.path.join(out_root, f"ops-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {
                "cc_distribution": {"enable": True, "cc_pre_hook": True},
                "step_interval": 2,
                "ops": list(OPS),
                "ndigits": 12,
                "format": ["csv", "parquet", "prometheus"],
                "alert": {"dump": True},
            },
            fh,
        )
    original = dist.all_reduce
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    patched = []
    for step in range(STEPS):
        patched.append(dist.all_reduce is not original)
        model(torch.ones(1, 2)).sum().backward()
        _collectives(rank, world, step)
        model(torch.ones(1, 2)).sum().backward()  # a second micro-batch
        _second_micro(step)
        opt.step()
        opt.zero_grad()
    probe = monitor.loop.probes[-1]
    violations = [(s, v.key.op, v.stat) for s, v in probe.violations]
    monitor.flush()
    from tests.sinks.test_prometheus import scrape, url_of

    series = {
        (dict(labels)["layer"], dict(labels)["stat"]): v
        for (name, labels), v in scrape(url_of(monitor)).items()
        if name == "trainermon_layer_stat" and dict(labels).get("family") == "comm"
    }
    monitor.close()
    return {
        "unmatched_warning": _unmatched_codeline(rank, out_root),
        "patched": patched,
        "restored": dist.all_reduce is original,
        "violations": violations,
        "unchecked": probe.unchecked,
        "run_dir": monitor.loop.outputs.run_dir,
        "series": series,
    }


def _unmatched_codeline(rank: int, out_root: str) -> list[str]:
    """cc_codeline that matches no call site: warned once, naming the patterns and the sites seen."""
    import logging

    from trainermon import TrainerMon

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainermon").addHandler(handler)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "unmatched")
    cfg = os.path.join(out_root, f"unmatched-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"cc_distribution": {"enable": True, "cc_codeline": ["no_such_file"]}}, fh)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        dist.all_reduce(torch.ones(2))
        opt.step()
    monitor.close()
    logging.getLogger("trainermon").removeHandler(handler)
    return [m for m in messages if "cc_codeline" in m]


def _row(rows: list[dict], prefix: str, step: int) -> dict:
    found = [r for r in rows if r["name"].startswith(prefix + "@") and int(r["step"]) == step]
    assert len(found) == 1, (prefix, step, [r["name"] for r in rows if int(r["step"]) == step])
    return found[0]


def _close(got: float, want: float, scale: float) -> bool:
    return abs(got - want) <= 1e-6 * scale + 1e-9


def test_every_op_against_references(tmp_path):
    world = 2
    results = run_ranks(_ops_rank, world_size=world, out_root=str(tmp_path))
    for rank, res in enumerate(results):
        (warning,) = res["unmatched_warning"]  # once, though two steps saw the site
        assert (
            "no_such_file" in warning and "test_comm_ops.py" in warning and "_unmatched_codeline" in warning
        )
        assert res["patched"] == [True, False, True, False], res["patched"]  # collected steps only
        assert res["restored"]
        assert res["violations"] == [], res["violations"]  # correct collectives: no false alarm
        assert res["unchecked"] == 0
        rows = read_family(res["run_dir"], "comm")
        for step in (0, 2):
            for key, ref in _expected(world, step).items():
                if rank == 1 and key in ("reduce/world/output", "send/world/input", "isend/world/input"):
                    continue  # rank 1 is not reduce's destination and sends nothing point-to-point
                if key == "batch_isend/world/input" and rank == 1:
                    ref = known(1, step, salt=10.0)
                if key == "batch_irecv/world/output" and rank == 1:
                    ref = known(0, step, salt=10.0)
                if key == "all_reduce/world/input":
                    ref = known(rank, step)
                if key == "reduce_scatter_tensor/world/output":
                    ref = sum(known(r, step, n=3 * world, salt=5.0) for r in range(world))[
                        3 * rank : 3 * rank + 3
                    ]
                if key == "all_to_all_single/world/output":
                    ref = torch.cat(
                        [known(r, step, n=2 * world, salt=6.0)[2 * rank : 2 * rank + 2] for r in range(world)]
                    )
                op, _, io = key.split("/")
                name = "all_reduce/world/" + io if op == "all_reduce_max" else key
                matches = [r for r in rows if r["name"].startswith(name + "@") and int(r["step"]) == step]
                if op in ("all_reduce", "all_reduce_max"):
                    # two all_reduce call sites: told apart by their line, found by value
                    want = ref_stats(ref)
                    assert any(
                        _close(float(r["max"]), want["max"], 1)
                        and _close(float(r["norm"]), want["norm"], want["norm"])
                        for r in matches
                    ), (key, matches)
                    continue
                assert len(matches) == 1, (key, step, [r["name"] for r in rows])
                row, want = matches[0], ref_stats(ref)
                for stat in OPS:
                    assert _close(float(row[stat]), want[stat], abs(want[stat]) + want["norm"]), (
                        key,
                        stat,
                        row,
                        want,
                    )
                assert int(row["calls"]) == 1
                assert int(row["bytes"]) == ref.numel() * 4
        barrier = _row(rows, "barrier/world/calls", 0)
        assert int(barrier["calls"]) == 1 and int(barrier["bytes"]) == 0
        assert not [r for r in rows if int(r["step"]) in (1, 3)]  # nothing on steps not collected
        # micro_step: forwards of the model so far in the step (the second forward's call is micro 1)
        second = [r for r in rows if "_second_micro" in r["name"] and "/output@" in r["name"]]
        assert [(r["step"], r["micro_step"], float(r["max"])) for r in second] == [
            ("0", "1", 1.0 * world),
            ("2", "1", 3.0 * world),
        ]
        assert all(r["micro_step"] == ("1" if "_second_micro" in r["name"] else "0") for r in rows)
        # Prometheus: one series per (op, group, input/output), call sites combined (norm: sqrt of the
        # sum of squares), from the last collected step
        series = res["series"]
        last = [r for r in rows if r["step"] == "2"]
        for layer in ("all_reduce/world/output", "broadcast/world/output", "all_gather/world/output"):
            norms = [float(r["norm"]) for r in last if r["name"].startswith(layer + "@")]
            assert math.isclose(series[(layer, "norm")], math.sqrt(sum(n * n for n in norms)), rel_tol=1e-9)
            maxes = [float(r["max"]) for r in last if r["name"].startswith(layer + "@")]
            assert series[(layer, "max")] == max(maxes)
    # Parquet family `comm` with the calls and bytes columns
    import pyarrow.dataset as ds

    root = os.path.join(str(tmp_path), "ops", "parquet")
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table().to_pylist()
    comm = [r for r in table if str(r.get("family")) == "comm"]
    assert comm and all(r["calls"] >= 1 for r in comm)
    assert math.isclose(
        sum(r["bytes"] for r in comm if r["name"].startswith("all_gather/world/output@") and r["step"] == 0),
        2 * 12 * 4,  # both ranks, 2 x 6 float32 each
    )
