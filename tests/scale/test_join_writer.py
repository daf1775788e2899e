"""DDP's `model.join()` when rank 0, the one writer of replicated rows (grad_reduced, optimizer moments,
param_*), runs out of inputs first (2 and 3 gloo ranks). A rank left stepping alone: DDP sums the gradients of
the ranks still stepping (its own) and divides by the initial world size (`join()`'s default), so its
reduced gradient is exact on its own, and it writes those rows for its later steps, said once. While
several ranks step without rank 0, none can tell, and those steps have no such rows: said once on each.
They used to go unwritten, unsaid. Values against an unwrapped float64 replica fed the batches of the
ranks stepping at each step, with its own Adam."""

from __future__ import annotations

import json
import logging
import os

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


def _job(rank: int, world: int, out: str, batches: tuple) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        keys = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
        json.dump({**keys, "ops": list(OPS), "ndigits": 12}, fh)
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    ddp = nn.parallel.DistributedDataParallel(_net())
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    with ddp.join():
        for step in range(batches[rank]):
            ddp(_x(rank, step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    logging.getLogger("trainermon").removeHandler(said)
    return {"run_dir": mon.run_dir, "said": said.lines, "faults": mon.faults.total}


def _reference(batches: tuple) -> dict:
    """float64 tensors keyed (family, name, step): the gradient summed over the ranks still stepping,
    divided by the world size."""
    model = _net().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    want = {}
    for step in range(max(batches)):
        ranks = [r for r, n in enumerate(batches) if step < n]
        opt.zero_grad()
        for r in ranks:
            (model(_x(r, step).double()).pow(2).mean() / len(batches)).backward()
        for name, p in model.named_parameters():
            want[("grad_reduced", name, step)] = p.grad.clone()
            want[("param_origin", name, step)] = p.detach().clone()
        opt.step()
        for name, p in model.named_parameters():
            want[("param_updated", name, step)] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                want[(key, name, step)] = opt.state[p][key].clone()
    return want


def _check(batches: tuple, writes: tuple, alone: tuple, unwritten: tuple, tmp_path) -> None:
    """`writes[r]`: the steps whose replicated rows rank r writes; `alone`, `unwritten`: how many times each
    rank says it is the last one stepping, and that rows may go unwritten."""
    runs = run_ranks(_job, world_size=len(batches), timeout=300, out=str(tmp_path), batches=batches)
    want = _reference(batches)
    families = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
    names = [n for n, _ in _net().named_parameters()]
    for rank, res in enumerate(runs):
        assert res["faults"] == 0, res
        for family in families:
            rows = keyed(read_family(res["run_dir"], family))
            expected = {(n, s, None) for n in names for s in writes[rank]}
            assert set(rows) == expected, (rank, family, sorted(rows))  # every step once, no duplicates
            for (name, step, _), row in rows.items():
                assert_row_matches(row, ref_stats(want[(family, name, step)]), OPS, rtol=1e-4)
        said = [
            sum(text in line for line in res["said"]) for text in ("last rank still", "written by no rank")
        ]
        assert said == [alone[rank], unwritten[rank]], res["said"]


def test_last_rank_stepping_writes_replicated_rows(tmp_path):
    # rank 0 (the writer) runs out first: rank 1, alone, writes steps 3-4
    _check((3, 5), (range(0, 3), range(3, 5)), (0, 1), (0, 0), tmp_path)


def test_three_ranks_gap_said_then_last_rank_writes(tmp_path):
    # rank 0 out after step 1: ranks 1 and 2 cannot tell who ran out (steps 2-3: no rows, said once each);
    # rank 1 out after step 3: rank 2, alone, writes steps 4-5
    _check((2, 4, 6), (range(0, 2), (), range(4, 6)), (0, 0, 1), (0, 1, 1), tmp_path)
