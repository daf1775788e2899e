"""Ranks that stop taking part: DDP's `model.join()` for uneven inputs, and a rank that dies. On 2 gloo ranks.

- Join: a rank out of batches shadows only DDP's own collectives. The monitor's cross-rank summaries
  (on by default), communication checks and dynamic-control broadcast used to wait for it: the job hung
  until the process-group timeout, then an exception reached the training loop. They now pause (said
  once); each rank writes its own rows for each of its steps.
- A rank dies: the survivor's cross-rank reduction fails. That used to drop the survivor's whole step,
  at every later step, silently after the first error; now the summaries stop (one counted fault) and
  the survivor's rows go on.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family


def _config(path: str, **keys) -> str:
    with open(path, "w") as fh:
        json.dump({"xy_distribution": True, "wg_distribution": True, "ops": ["norm", "max"], **keys}, fh)
    return path


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _join_job(rank: int, world: int, out: str) -> dict:
    # the monitor given the DDP wrapper, then the module inside it (the wrapper found among live objects)
    return {inner: _join_run(rank, os.path.join(out, str(inner)), inner) for inner in (False, True)}


def _join_run(rank: int, out: str, inner: bool) -> dict:
    import torch.distributed as dist

    from trainermon import TrainerMon

    os.makedirs(out, exist_ok=True)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ["DYNAMIC_MONITOR"] = "true"  # the control's per-step broadcast is a collective too
    cfg = _config(
        os.path.join(out, f"cfg{rank}.json"),
        dynamic_on=True,
        collect_times=100,
        cc_distribution={"enable": True},
    )
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model.module if inner else model, grad_acc_steps=1, optimizer=opt)
    batches = 4 if rank == 0 else 2  # uneven inputs
    inputs = []
    with model.join():
        for step in range(batches):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
            inputs.append(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    logging.getLogger("trainermon").removeHandler(said)
    dist.barrier()
    return {
        "run_dir": mon.run_dir,
        "faults": mon.faults.total,
        "said": said.lines,
        "inputs": [x.tolist() for x in inputs],  # plain lists: no shared memory past the rank's exit
    }


def test_join_with_uneven_inputs_finishes_and_keeps_rows(tmp_path):
    runs = run_ranks(_join_job, world_size=2, timeout=240, out=str(tmp_path))
    for inner in (False, True):
        _check_join_run([by_rank[inner] for by_rank in runs])


def _check_join_run(results: list) -> None:
    for rank, res in enumerate(results):
        assert res["faults"] == 0, res
        paused = [line for line in res["said"] if "Join context" in line]
        assert len(paused) == 1, res["said"]
        rows = read_family(res["run_dir"], "actv")
        steps = sorted({int(r["step"]) for r in rows})
        assert steps == list(range(len(res["inputs"]))), (rank, steps)  # every step of this rank's own
        x = torch.tensor(res["inputs"][0])  # step 0's input row: this rank's own batch
        got = [r for r in rows if r["name"] == "0.input" and int(r["step"]) == 0]
        want = torch.linalg.vector_norm(x).item()
        assert len(got) == 1 and abs(float(got[0]["norm"]) - want) <= 1e-5 * want
    assert read_family(results[0]["run_dir"], "xrank") == []  # paused from the first step on


def _dying_job(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = _config(os.path.join(out, f"cfg{rank}.json"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    steps = 4 if rank == 0 else 2
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    if rank == 1:  # gone: its connections close, the survivor's next reduction fails
        dist.destroy_process_group()
        return {}
    mon.close()
    return {"run_dir": mon.run_dir, "faults": dict(mon.faults.counts)}


def test_survivor_of_a_dead_rank_keeps_its_rows(tmp_path):
    survivor = run_ranks(_dying_job, world_size=2, timeout=240, out=str(tmp_path))[0]
    assert survivor["faults"] == {"cross-rank summaries": 1}, survivor
    steps = sorted({int(r["step"]) for r in read_family(survivor["run_dir"], "actv")})
    assert steps == [0, 1, 2, 3]
    xrank_steps = sorted({int(r["step"]) for r in read_family(survivor["run_dir"], "xrank")})
    assert xrank_steps == [0, 1]  # while both ranks lived
