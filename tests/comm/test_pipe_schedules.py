"""torch.distributed.pipelining schedules on 2 gloo ranks (4 micro-batches, 2 Adam steps): the micro_step of
`cc_distribution`'s p2p rows and of `monitor_mbs_grad`'s per-micro-batch gradients, against a float64
single-process run of the same model and data computed here.

- comm: what stage s sends for micro-batch k is layers.s's output of k (forward) and the gradient of
  layers.(s-1)'s output of k (backward); what it receives is the previous stage's output and the gradient
  of its own output. Per (rank, step, micro_step) the rows of isend/batch_isend inputs (and irecv/batch_irecv
  outputs) must hold exactly those tensors: their count and the norm of them together. The stage's shape
  inference and warm-up vote at the first step are no micro-batch's data: no row. A send writes no
  "output" row (it has none). Every row's call site is this file's `schedule.step` line.
- grads: every parameter's micro-batch gradient under its own micro_step (ScheduleLoopedBFS runs its
  backwards in reverse micro-batch order).

Tolerances: float32 through at most 5 linear layers of width 8: 1e-4 relative to a tensor's norm bounds the
difference with a wide margin; a wrong micro-batch moves the norms by over 1% (checked in the reference).
"""

from __future__ import annotations

import copy
import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

D, MICRO, BATCH, STEPS, RTOL = 8, 4, 8, 2, 1e-4
#: case -> (schedule class name, stages per rank)
CASES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1), "looped": ("ScheduleLoopedBFS", 2)}
CASES["interleaved"] = ("ScheduleInterleaved1F1B", 2)
P2P = ("isend", "irecv", "send", "recv")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Model(nn.Module):
    def __init__(self, stages: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(stages)})
        self.out: nn.Module | None = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if self.out is None else self.out(x)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)


def stages_of(rank: int, world: int, per_rank: int) -> list[int]:
    return [rank + world * i for i in range(per_rank)]


def _part(full: Model, stage: int, count: int) -> Model:
    part = copy.deepcopy(full)
    for key in list(part.layers):
        if int(key) != stage:
            del part.layers[key]
    if stage != count - 1:
        part.out = None
    return part


def _rank(rank: int, world: int, out_root: str) -> dict:
    import gc

    from torch.distributed import pipelining

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    cfg = os.path.join(out_root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        config = {"wg_distribution": True, "monitor_mbs_grad": True, "ops": ["norm"], "ndigits": 12}
        json.dump({**config, "cc_distribution": {"enable": True}}, fh)
    runs = {}
    for case, (kind, per_rank) in CASES.items():
        count = world * per_rank
        torch.manual_seed(0)
        full = Model(count)
        stages = stages_of(rank, world, per_rank)
        parts = [_part(full, s, count) for s in stages]
        pipe = [pipelining.PipelineStage(m, s, count, torch.device("cpu")) for m, s in zip(parts, stages)]
        cls = getattr(pipelining, kind)
        schedule = cls(pipe if per_rank > 1 else pipe[0], MICRO, loss_fn=loss_fn)
        optimizer = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=1e-2)
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, case)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(parts if per_rank > 1 else parts[0], grad_acc_steps=MICRO, optimizer=optimizer)
        for step in range(STEPS):
            x, y = batch(step)
            kwargs = {"target": y, "losses": []} if count - 1 in stages else {}
            schedule.step(*([x] if 0 in stages else []), **kwargs)  # THE_STEP_LINE
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
        runs[case] = monitor.run_dir
        del schedule, pipe, parts, monitor
        gc.collect()
        dist.barrier()
    return {"runs": runs, "stages": {case: stages_of(rank, world, CASES[case][1]) for case in CASES}}


def _reference(count: int) -> dict:
    """float64, one process: per micro-batch the layers' outputs, their gradients and the parameters'."""
    torch.manual_seed(0)
    model = Model(count).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref: dict = {}
    names = [n for n, _ in model.named_parameters()]
    for step in range(STEPS):
        x, y = batch(step)
        for k, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            outs = []
            hooks = [
                layer.register_forward_hook(lambda m, a, o, outs=outs: outs.append(o))
                for layer in model.layers.values()
            ]
            loss = loss_fn(model(xm.double()), ym.double())
            for h in hooks:
                h.remove()
            grads = torch.autograd.grad(loss, outs + list(model.parameters()))
            for s in range(count):
                ref["actv", s, step, k] = outs[s].detach()
                ref["actv_grad", s, step, k] = grads[s]
            for n, g in zip(names, grads[count:]):
                ref["mbs", n, step, k] = float(g.norm())
                p = dict(model.named_parameters())[n]
                p.grad = g / MICRO if p.grad is None else p.grad + g / MICRO
        optimizer.step()
        optimizer.zero_grad()
    return ref


def _expected_p2p(ref: dict, stages: list[int], count: int) -> dict:
    """(step, micro, "send"|"recv") -> (calls, norm of every tensor together) for a rank's stages."""
    want: dict = {}
    for step in range(STEPS):
        for k in range(MICRO):
            for s in stages:
                sent = ([ref["actv", s, step, k]] if s < count - 1 else []) + (
                    [ref["actv_grad", s - 1, step, k]] if s > 0 else []
                )
                got = ([ref["actv", s - 1, step, k]] if s > 0 else []) + (
                    [ref["actv_grad", s, step, k]] if s < count - 1 else []
                )
                for way, tensors in (("send", sent), ("recv", got)):
                    calls, sq = want.get((step, k, way), (0, 0.0))
                    want[step, k, way] = (
                        calls + len(tensors),
                        sq + sum(float(t.norm()) ** 2 for t in tensors),
                    )
    return {key: (calls, math.sqrt(sq)) for key, (calls, sq) in want.items()}


def test_pipeline_schedules_micro_steps(tmp_path):
    results = run_ranks(_rank, world_size=2, out_root=str(tmp_path))
    line = next(i for i, text in enumerate(open(__file__), 1) if "THE_STEP_LINE" in text)
    for case, (_, per_rank) in CASES.items():
        count = 2 * per_rank
        ref = _reference(count)
        # the check can tell micro-batches apart: their sent tensors differ by over 1%
        norms = sorted(float(ref["actv", 0, 0, k].norm()) for k in range(MICRO))
        assert all(b > a * 1.01 for a, b in zip(norms, norms[1:])), norms
        seen_mbs: dict = {}
        for rank, res in enumerate(results):
            run_dir = res["runs"][case]
            got: dict = {}
            for row in read_family(run_dir, "comm"):
                name = row["name"]
                op, _, rest = name.partition("/")
                assert f"test_pipe_schedules.py:{line}(" in name, (case, rank, name)  # the user's line
                op = op.removeprefix("batch_")
                assert op in P2P, (case, rank, name)  # nothing else runs a collective here
                io = rest.split("@")[0].split("/")[-1]
                way = "send" if op in ("isend", "send") else "recv"
                assert io == ("input" if way == "send" else "output"), (case, rank, name)  # no empty row
                key = (int(row["step"]), int(row["micro_step"]), way)
                calls, sq = got.get(key, (0, 0.0))
                got[key] = (calls + int(row["calls"]), sq + float(row["norm"]) ** 2)
            want = _expected_p2p(ref, res["stages"][case], count)
            want = {key: v for key, v in want.items() if v[0]}
            assert set(got) == set(want), (case, rank, sorted(set(got) ^ set(want)))
            for key, (calls, norm) in want.items():
                assert got[key][0] == calls, (case, rank, key, got[key], calls)
                assert abs(math.sqrt(got[key][1]) - norm) <= RTOL * norm, (case, rank, key, got[key], norm)
            for row in read_family(run_dir, "grad_unreduced"):
                key = ("mbs", row["name"], int(row["step"]), int(row["micro_step"]))
                assert key not in seen_mbs, (case, key)
                seen_mbs[key] = float(row["norm"])
        wanted = {key for key in ref if key[0] == "mbs"}
        assert set(seen_mbs) == wanted, (case, sorted(set(seen_mbs) ^ wanted)[:4])
        for key in wanted:
            assert abs(seen_mbs[key] - ref[key]) <= RTOL * ref[key], (case, key, seen_mbs[key], ref[key])


def test_call_site_skips_trainermon_adapters_and_exporters():
    """A collective asked for by a frame of `trainermon.adapters` or `trainermon.exporters` (an editable
    install keeps them in the repository's adapters/ and exporters/, beside trainermon/) has its site at
    the first frame outside them: here this test's line."""
    import importlib.util
    import sys

    from trainermon.comm.sites import call_site

    for package in ("trainermon.adapters", "trainermon.exporters"):
        folder = os.path.realpath(importlib.util.find_spec(package).submodule_search_locations[0])
        code = compile("def ask():\n    return call_site(1)\n", os.path.join(folder, "_probe.py"), "exec")
        space = {"call_site": call_site}
        exec(code, space)  # noqa: S102 - a function whose frame lies in the package's folder
        line = sys._getframe().f_lineno + 1
        site = space["ask"]()
        assert site == f"{__file__}:{line}(test_call_site_skips_trainermon_adapters_and_exporters)", site
