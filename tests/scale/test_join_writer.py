"""DDP's `model.join()` when rank 0, the one writer of replicated rows (grad_reduced, optimizer moments,
param_*), runs out of inputs first (2 and 3 gloo ranks). A rank left stepping alone: DDP sums the gradients of
the ranks still stepping (its own) and divides by the initial world size (`join()`'s default), so its
reduced gradient is exact on its own, and it writes those rows for its later steps, said once. While
several ranks step without rank 0, none can tell, and those steps have no such rows: said once on each.
They used to go unwritten, unsaid. Values against an unwrapped float64 replica fed the batches of the
ranks stepping at each step, with its own Adam.

One `ddp.join()` per epoch, an uneven epoch then even ones: the rank left stepping alone writes those rows
only while the others are out; from the next epoch on rank 0 writes them again. They used to stay with that
rank for good: later epochs' rows written by both ranks, under different step numbers."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    # SGD across epochs: DDP's join hook syncs the parameters at a context's end but not Adam's state, so
    # under Adam the ranks' parameters differ in the next epoch (no replica to check against)
    return torch.optim.Adam(params, lr=0.01) if name == "adam" else torch.optim.SGD(params, lr=0.01)


def _families(opt: str) -> tuple:
    moments = ("exp_avg", "exp_avg_sq") if opt == "adam" else ()
    return ("grad_reduced", "param_origin", "param_updated", *moments)


def _job(rank: int, world: int, out: str, epochs: tuple, opt_name: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        keys = {"wg_distribution": True, "mv_distribution": opt_name == "adam", "param_distribution": True}
        json.dump({**keys, "ops": list(OPS), "ndigits": 12}, fh)
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    ddp = nn.parallel.DistributedDataParallel(_net())
    opt = _optimizer(opt_name, ddp.parameters())
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    step = 0
    for batches in epochs:
        with ddp.join():
            for _ in range(batches[rank]):
                ddp(_x(rank, step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                step += 1
    mon.close()
    logging.getLogger("trainermon").removeHandler(said)
    return {"run_dir": mon.run_dir, "said": said.lines, "faults": mon.faults.total}


def _reference(epochs: tuple, opt_name: str) -> tuple[dict, list]:
    """float64 tensors keyed (family, name, iteration): the gradient summed over the ranks still stepping,
    divided by the world size; and, for each rank, the iteration of each of its own steps."""
    model = _net().double()
    opt = _optimizer(opt_name, model.parameters())
    want, at, it = {}, [[] for _ in epochs[0]], -1
    for batches in epochs:
        for i in range(max(batches)):
            ranks = [r for r, n in enumerate(batches) if i < n]
            it += 1
            opt.zero_grad()
            for r in ranks:
                (model(_x(r, len(at[r])).double()).pow(2).mean() / len(batches)).backward()
                at[r].append(it)
            for name, p in model.named_parameters():
                want[("grad_reduced", name, it)] = p.grad.clone()
                want[("param_origin", name, it)] = p.detach().clone()
            opt.step()
            for name, p in model.named_parameters():
                want[("param_updated", name, it)] = p.detach().clone()
                for key in ("exp_avg", "exp_avg_sq") if opt_name == "adam" else ():
                    want[(key, name, it)] = opt.state[p][key].clone()
    return want, at


def _check(
    epochs: tuple, writes: tuple, alone: tuple, unwritten: tuple, tmp_path, opt_name: str = "adam"
) -> None:
    """`epochs`: each rank's batches in each Join context; `writes[r]`: the steps (rank r's own count) whose
    replicated rows rank r writes; `alone`, `unwritten`: how many times each rank says it is the last one
    stepping, and that rows may go unwritten."""
    world = len(epochs[0])
    runs = run_ranks(_job, world_size=world, timeout=300, out=str(tmp_path), epochs=epochs, opt_name=opt_name)
    want, at = _reference(epochs, opt_name)
    names = [n for n, _ in _net().named_parameters()]
    written: Counter = Counter()  # iteration -> how many ranks wrote its rows
    for rank, res in enumerate(runs):
        assert res["faults"] == 0, res
        for family in _families(opt_name):
            rows = keyed(read_family(res["run_dir"], family))
            expected = {(n, s, None) for n in names for s in writes[rank]}
            assert set(rows) == expected, (rank, family, sorted(rows))  # every step once, no duplicates
            for (name, step, _), row in rows.items():
                assert_row_matches(row, ref_stats(want[(family, name, at[rank][step])]), OPS, rtol=1e-4)
        written.update(at[rank][s] for s in writes[rank])
        said = [
            sum(text in line for line in res["said"]) for text in ("last rank still", "written by no rank")
        ]
        assert said == [alone[rank], unwritten[rank]], res["said"]
    assert all(n == 1 for n in written.values()), written  # no iteration's rows from two ranks


def test_last_rank_stepping_writes_replicated_rows(tmp_path):
    # rank 0 (the writer) runs out first: rank 1, alone, writes steps 3-4
    _check(((3, 5),), (range(0, 3), range(3, 5)), (0, 1), (0, 0), tmp_path)


def test_three_ranks_gap_said_then_last_rank_writes(tmp_path):
    # rank 0 out after step 1: ranks 1 and 2 cannot tell who ran out (steps 2-3: no rows, said once each);
    # rank 1 out after step 3: rank 2, alone, writes steps 4-5
    _check(((2, 4, 6),), (range(0, 2), (), range(4, 6)), (0, 0, 1), (0, 1, 1), tmp_path)


def test_writer_handover_ends_with_the_join_context(tmp_path):
    # one Join context per epoch. Epoch 1 (2, 4): rank 1 alone writes iterations 2-3 (its steps 2-3).
    # Epoch 2 (3, 3): rank 0 writes again (its steps 2-4; rank 1's 4-6 unwritten by it). Epoch 3 (1, 2):
    # rank 0 writes its step 5, rank 1 alone again its step 8, said again
    epochs = ((2, 4), (3, 3), (1, 2))
    _check(epochs, (range(0, 6), (2, 3, 8)), (0, 2), (0, 0), tmp_path, opt_name="sgd")
