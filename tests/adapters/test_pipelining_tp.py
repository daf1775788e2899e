"""torch.distributed.pipelining with tensor parallelism, and with a zero-bubble schedule, on 4 gloo ranks in
one launch (the same workers run the cases in turn). Every row against a float64 recompute of the whole
model in the test, with the same data and micro-batches.

- "pp-tp": PP2 x TP2 on a ("pp", "tp") mesh, 1F1B; each stage `parallelize_module`s its blocks (lin1
  Colwise, lin2 Rowwise) and leaves plain parameters beside the DTensor ones: each block's `gate`, the
  last stage's `out`. Those are copies over the stage's TP ranks only: they were written by world rank 0
  alone, so the last stage's had no row and were missing from the global grad norm.
- "zb-interleaved" and "zbv": PP4 with `ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble`, two
  stages per rank, with per-micro-batch gradients (`monitor_mbs_grad`). No data parallelism: torch 2.13's
  zero-bubble schedules give wrong gradients under FSDP2 and fail in DDP's reducer. The "weight" pass runs
  autograd again from the nodes where the "input" pass met the parameters' subgraphs (a Linear's output
  node): their actv_grad rows were written twice. A gate's output, made from its parameter alone, is
  reached by the weight pass only, and keeps its row; the parameters' micro-batch gradients come from
  the weight pass. Each (rank, name, step, micro-step) row must be written once.

A rank's actv/actv_grad/grad_unreduced rows are its own values: the piece its shard label (or, for a
Rowwise input, its shape) says, of the whole model's tensor. The gradient of a Colwise module's input is
this rank's summand (`Partial(sum)[tp=i/2]`): checked by its mean, the TP ranks' means adding up to the
whole gradient's.

Tolerances: the model runs in float32 through at most 8 blocks of width 8 and 2 Adam steps; each value
gathers at most a few hundred float32 roundings (relative 6e-8 each) of magnitudes within a factor of 10 of
the result, so 1e-4 relative (of the tensor's norm, for min/max and mean) bounds the difference with a wide
margin, while a missing micro-batch, stage, TP piece or a row counted twice moves a value by over 1%.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from tests.adapters.test_pipelining import loss_fn, stage_part
from tests.distributed import run_ranks
from tests.helpers import read_family, write_config

D, BATCH, MICRO, STEPS = 8, 8, 4, 2
CASES = ("pp-tp", "zb-interleaved", "zbv")
LAYERS = {"pp-tp": 4, "zb-interleaved": 8, "zbv": 8}
RTOL = 1e-4
STATS = ("norm", "min", "max", "mean")


class Gate(nn.Module):
    """An output made from a parameter alone: its gradient node lies off the path to the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(1.0 + 0.1 * torch.randn(D))

    def forward(self) -> torch.Tensor:
        return self.w * 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x))) * self.gate()


class Model(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.out: nn.Module | None = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if self.out is None else self.out(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 7)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)


def reference(layers: int) -> dict:
    """float64 whole model: (family, name, step[, micro]) -> the tensor; "norm": the global grad norms.
    An input's gradient is that of a view made for its module (the gradient that flows into it)."""
    torch.manual_seed(0)
    model = Model(layers).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    names = {id(m): n for n, m in model.named_modules() if n}
    ref: dict = {"norm": []}
    for step in range(STEPS):
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        x, y = batch(step)
        for micro, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            seen: dict = {}

            def pre(m: nn.Module, args: tuple, seen: dict = seen) -> tuple | None:
                if not args:
                    return None
                view = args[0].view_as(args[0])
                seen[f"{names[id(m)]}.input"] = view
                return (view,)

            def post(m: nn.Module, args: tuple, out: torch.Tensor, seen: dict = seen) -> None:
                seen[f"{names[id(m)]}.output"] = out

            modules = [m for m in model.modules() if id(m) in names]
            handles = [m.register_forward_pre_hook(pre) for m in modules]
            handles += [m.register_forward_hook(post) for m in modules]
            loss = loss_fn(model(xm.double()), ym.double())
            for h in handles:
                h.remove()
            wanted = {k: t for k, t in seen.items() if t.requires_grad}
            params = dict(model.named_parameters())
            grads = torch.autograd.grad(loss, [*wanted.values(), *params.values()])
            for name, t in seen.items():
                ref["actv", name, step, micro] = t.detach().clone()
            for name, g in zip([*wanted, *params], grads):
                family = "actv_grad" if name in wanted else "grad_micro"
                ref[family, name, step, micro] = g
                if name in params:
                    total[name] += g
        for name, p in model.named_parameters():
            p.grad = total[name] / MICRO  # the schedule scales the gradients by the micro-batch count
            ref["grad_unreduced", name, step] = ref["grad_reduced", name, step] = p.grad.clone()
            ref["param_origin", name, step] = p.detach().clone()
        ref["norm"].append(float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))))
        opt.step()
        for name, p in model.named_parameters():
            ref["exp_avg", name, step] = opt.state[p]["exp_avg"].clone()
        opt.zero_grad()
    ref["names"] = sorted(n for n, _ in model.named_parameters())
    return ref


def _worker(rank: int, world: int, configs: dict, out_dir: str) -> dict:
    return {case: _run_case(rank, case, configs[case], out_dir) for case in CASES}


def _run_case(rank: int, case: str, config: str, out_dir: str) -> dict:
    from torch.distributed import pipelining

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = Model(LAYERS[case])
    group, tp = None, 0
    if case == "pp-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pp, tp = divmod(rank, 2)
        stages, count, layers = [pp], 2, {0: [0, 1], 1: [2, 3]}
        group = mesh["pp"].get_group()
    else:  # stage s holds layer s; interleaved: stages r and r + 4 on rank r; V: r and 7 - r
        stages, count, layers = [rank, rank + 4 if case == "zb-interleaved" else 7 - rank], 8, None
    parts = [stage_part(full, layers[s] if layers else [s], s == count - 1) for s in stages]
    if case == "pp-tp":
        for part in parts:
            plan = {f"layers.{k}.lin1": ColwiseParallel() for k in part.layers}
            plan.update({f"layers.{k}.lin2": RowwiseParallel() for k in part.layers})
            parallelize_module(part, mesh["tp"], plan)
    cpu = torch.device("cpu")
    pipeline = [pipelining.PipelineStage(m, s, count, cpu, group=group) for m, s in zip(parts, stages)]
    if case == "pp-tp":
        schedule = pipelining.Schedule1F1B(pipeline[0], MICRO, loss_fn=loss_fn)
    elif case == "zb-interleaved":
        schedule = pipelining.ScheduleInterleavedZeroBubble(pipeline, MICRO, loss_fn=loss_fn)
    else:
        schedule = pipelining.ScheduleZBVZeroBubble(pipeline, MICRO, loss_fn=loss_fn)
    opt = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=1e-2)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, case)
    monitor = TrainerMon(config)
    monitor.set_monitor(parts if len(parts) > 1 else parts[0], grad_acc_steps=MICRO, optimizer=opt)
    for step in range(STEPS):
        x, y = batch(step)
        last = {"target": y, "losses": []} if count - 1 in stages else {}
        if 0 in stages:
            schedule.step(x, **last)
        else:
            schedule.step(**last)
        opt.step()
        opt.zero_grad()
    monitor.flush()
    norm, faults = monitor.last_batch.derived.global_grad_norm, dict(monitor.faults.counts)
    monitor.close()
    dist.barrier()
    return {"run_dir": monitor.run_dir, "norm": norm, "faults": faults, "tp": tp}


def _stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double()
    return {"norm": float(t.norm()), "min": float(t.min()), "max": float(t.max()), "mean": float(t.mean())}


def _piece(full: torch.Tensor, row: dict, tp: int) -> torch.Tensor:
    """The piece of `full` a rank's row holds: the dimension its shard label names, else the one where its
    shape differs (a Rowwise module's input, which no style hook labels)."""
    label, shape = row["shard"], json.loads(row["shape"])
    if label.startswith("Shard("):
        return full.chunk(2, int(label[6 : label.index(")")]))[tp]
    if list(full.shape) == shape:
        return full
    (dim,) = [d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b]
    return full.chunk(2, dim)[tp]


def _close(got: str, want: dict, stat: str) -> bool:
    return abs(float(got) - want[stat]) <= RTOL * max(want["norm"], 1e-12)


def _check_local(case: str, results: list[dict], ref: dict, family: str, micro: bool) -> list:
    """A rank's own rows: each (rank, name, step[, micro]) once, each the right piece of the whole's."""
    wrong, seen, partial = [], Counter(), {}
    for rank, r in enumerate(results):
        for row in read_family(r["run_dir"], family):
            step = int(row["step"])
            key = (row["name"], step, int(row["micro_step"])) if micro else (row["name"], step)
            seen[(*key, r["tp"])] += 1
            refkey = ("grad_micro" if family == "grad_unreduced" and micro else family, *key)
            if refkey not in ref:
                wrong.append(("no such row", family, rank, key))
                continue
            if row["shard"].startswith("Partial("):  # a summand: the TP ranks' means add up
                partial.setdefault(refkey, []).append(float(row["mean"]))
                continue
            want = _stats(_piece(ref[refkey], row, r["tp"]))
            wrong += [("value", family, rank, key, s) for s in STATS if not _close(row[s], want, s)]
    for refkey, means in partial.items():
        want = _stats(ref[refkey])
        if len(means) != 2 or abs(sum(means) - want["mean"]) > RTOL * want["norm"]:
            wrong.append(("partial", family, refkey, means, want["mean"]))
    wrong += [("twice", family, key, n) for key, n in seen.items() if n != 1]
    prefix = "grad_micro" if family == "grad_unreduced" and micro else family
    tps = sorted({r["tp"] for r in results})
    expected = {(*k[1:], tp) for k in ref if k[0] == prefix for tp in tps}
    if set(seen) != expected:
        wrong.append(("rows", family, sorted(expected - set(seen))[:3], sorted(set(seen) - expected)[:3]))
    return wrong


def _check(case: str, results: list[dict], ref: dict) -> list:
    wrong: list = [("faults", "", r["faults"]) for r in results if r["faults"]]
    for r in results:  # every stage's gradients, on every rank: the pipeline's whole model
        if r["norm"] is None or abs(r["norm"] - ref["norm"][-1]) > RTOL * ref["norm"][-1]:
            wrong.append(("global norm", "", r["norm"], ref["norm"][-1]))
    for family in ("grad_reduced", "param_origin", "exp_avg"):  # whole tensors, one writer each
        writers: dict = {}
        for rank, r in enumerate(results):
            for row in read_family(r["run_dir"], family):
                writers.setdefault((row["name"], int(row["step"])), []).append((rank, row))
        if sorted({name for name, _ in writers}) != ref["names"]:
            wrong.append(("names", family, sorted(set(ref["names"]) - {name for name, _ in writers})))
        for (name, step), rows in writers.items():
            if len(rows) != 1:
                wrong.append(("writers", family, name, step, [rank for rank, _ in rows]))
            want = _stats(ref[family, name, step])
            wrong += [("value", family, name, step, s) for s in STATS if not _close(rows[0][1][s], want, s)]
    micro = case != "pp-tp"  # monitor_mbs_grad: a row per micro-batch
    for family, by_micro in (("grad_unreduced", micro), ("actv", True), ("actv_grad", True)):
        wrong += _check_local(case, results, ref, family, by_micro)
    return wrong


def test_pipelining_with_tensor_parallelism_and_zero_bubble(tmp_path):
    def config(name: str, mbs: bool) -> str:
        return write_config(
            tmp_path / f"{name}.json",
            targets={},
            xy_distribution=True,
            wg_distribution=True,
            mv_distribution=True,
            param_distribution=True,
            monitor_mbs_grad=mbs,
            ops=[*STATS, "shape"],
            ndigits=12,
        )

    configs = {case: config(case, case != "pp-tp") for case in CASES}
    results = run_ranks(_worker, world_size=4, timeout=600, configs=configs, out_dir=str(tmp_path))
    refs = {n: reference(n) for n in set(LAYERS.values())}
    failures = {case: _check(case, [r[case] for r in results], refs[LAYERS[case]]) for case in CASES}
    summary = {case: Counter(w[:2] for w in f) for case, f in failures.items() if f}  # (what, family)
    assert not summary, (summary, {case: f[:4] for case, f in failures.items()})
