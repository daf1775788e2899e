"""torch.distributed.pipelining (torchtitan's pipeline parallelism) on 4 gloo ranks, PP2 x DP2: interleaved
1F1B (two chunks per rank) with FSDP2 on the data-parallel dimension, 1F1B with DDP (torch 2.13's
interleaved schedule with two DDP chunks fails in DDP's reducer, with or without the monitor), and 1F1B
with DDP on stages built as `nn.Sequential` parts (the same local parameter names on both stages). Every
row against a float64 recompute of the whole model in the test, with the same data and micro-batches.
First, before any stage exists, a plain DDP job in which only rank 0 has imported pipelining: the ranks
must still agree (no hang) and the norm is DDP's.

Tolerances: the model runs in float32 through at most 5 linear layers of width 8 and 3 Adam steps; each
value gathers at most a few hundred float32 roundings (relative 6e-8 each) of magnitudes within a factor
of 10 of the result, so 1e-4 relative (of the tensor's norm, for min/max and mean) bounds the difference
with a wide margin, while a missing micro-batch, stage or replica moves every value by over 1%.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family, write_config

D, LAYERS, BATCH, MICRO, STEPS = 8, 4, 8, 4, 3
CASES = ("interleaved-fsdp2", "1f1b-ddp", "local-names-ddp")
RTOL = 1e-4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if self.out is None else self.out(x)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)


def stage_part(full: Model, layers: list[int], last: bool) -> Model:
    """torchtitan's split: the other stages' layers deleted, so the names keep their full FQNs."""
    part = copy.deepcopy(full)
    for key in list(part.layers):
        if int(key) not in layers:
            del part.layers[key]
    if not last:
        part.out = None
    return part


def _stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double()
    return {"norm": float(t.norm()), "min": float(t.min()), "max": float(t.max()), "mean": float(t.mean())}


def local_part(full: Model, layers: list[int]) -> nn.Sequential:
    """A stage as an `nn.Sequential` of its blocks: its parameters named "0.lin1.weight", ... on every stage
    (the model without `out`, so that both stages hold the very same names)."""
    return nn.Sequential(*(copy.deepcopy(full.layers[str(i)]) for i in layers))


def reference(with_out: bool = True) -> dict:
    """float64 whole model: per (family, name, step[, micro, dp]) statistics, and the global norms."""
    torch.manual_seed(0)
    model = Model().double()
    if not with_out:
        model.out = None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    modules = {id(m): n for n, m in model.named_modules() if n}
    ref: dict = {"norm": []}
    for step in range(STEPS):
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        first: dict = {}  # each replica's micro-batch 0 gradients
        for dp in range(2):
            local = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            x, y = batch(step, dp)
            for micro, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                outs: dict = {}

                def keep(m: nn.Module, args: tuple, out: torch.Tensor, outs: dict = outs) -> None:
                    outs[modules[id(m)]] = out

                handles = [m.register_forward_hook(keep) for m in model.modules() if id(m) in modules]
                loss = loss_fn(model(xm.double()), ym.double())
                for h in handles:
                    h.remove()
                grads = torch.autograd.grad(loss, list(outs.values()) + list(model.parameters()))
                for (name, out), g in zip(outs.items(), grads):
                    ref["actv", f"{name}.output", step, micro, dp] = _stats(out)
                    ref["actv_grad", f"{name}.output", step, micro, dp] = _stats(g)
                for (name, _), g in zip(model.named_parameters(), grads[len(outs) :]):
                    local[name] += g
                    first.setdefault((name, dp), g)
            for name in local:  # summed over micro-batches
                ref["grad_unreduced", name, step, dp] = {**_stats(local[name]), "value": local[name]}
                total[name] += local[name] / (MICRO * 2)
        if step == 0:  # DDP, see `_check`: micro-batch 0 averaged over the replicas, the rest local
            for name, dp in first:
                mean0 = (first[name, 0] + first[name, 1]) / 2
                ddp = ref["grad_unreduced", name, 0, dp]["value"] - first[name, dp] + mean0
                ref["ddp_step0", name, dp] = _stats(ddp)
        for name, p in model.named_parameters():
            p.grad = total[name]
            ref["grad_reduced", name, step] = _stats(p.grad)
            ref["param_origin", name, step] = _stats(p)
        ref["norm"].append(float(torch.sqrt(sum((g * g).sum() for g in total.values()))))
        opt.step()
        for name, p in model.named_parameters():
            ref["exp_avg", name, step] = _stats(opt.state[p]["exp_avg"])
        opt.zero_grad()
    ref["names"] = [n for n, _ in model.named_parameters()]
    return ref


def _worker(rank: int, world: int, config: str, out_dir: str) -> dict:
    first = _one_rank_imports(rank, config, out_dir)  # before any case imports pipelining everywhere
    return {"one-rank-imports": first, **{case: _run_case(rank, case, config, out_dir) for case in CASES}}


def _one_rank_imports(rank: int, config: str, out_dir: str) -> dict:
    """Plain DDP over the 4 ranks; rank 0 alone has imported pipelining (as a library might do for it)."""
    import importlib
    import sys

    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    if rank == 0:
        importlib.import_module("torch.distributed.pipelining")  # on this rank only
    imported = "torch.distributed.pipelining.stage" in sys.modules
    torch.manual_seed(0)
    model = DDP(Model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, "one-rank-imports")
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    x, y = batch(0, rank)
    loss_fn(model(x), y).backward()
    want = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    opt.step()
    opt.zero_grad()
    monitor.flush()
    norm, faults = monitor.last_batch.derived.global_grad_norm, monitor.faults.total
    monitor.close()
    return {"imported": imported, "norm": norm, "want": want, "faults": faults}


def _run_case(rank: int, case: str, config: str, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = divmod(rank, 2)
    torch.manual_seed(0)
    full = Model()
    if case.startswith("interleaved"):  # stage s holds layer s; this rank holds stages pp and pp + 2
        stages, layers = [pp, pp + 2], {s: [s] for s in range(4)}
    else:
        stages, layers = [pp], {0: [0, 1], 1: [2, 3]}
    count = 2 * len(stages)
    if case == "local-names-ddp":
        parts = [local_part(full, layers[s]) for s in stages]
    else:
        parts = [stage_part(full, layers[s], s == count - 1) for s in stages]
    if case == "interleaved-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for part in parts:
            for block in part.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        parts = [DDP(part, process_group=mesh["dp"].get_group()) for part in parts]
    group = mesh["pp"].get_group()
    pipeline = [PipelineStage(m, s, count, torch.device("cpu"), group=group) for m, s in zip(parts, stages)]
    if len(pipeline) == 1:
        schedule = Schedule1F1B(pipeline[0], MICRO, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(pipeline, MICRO, loss_fn=loss_fn)
    opt = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=1e-2)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, case)
    monitor = TrainerMon(config)
    monitor.set_monitor(parts if len(parts) > 1 else parts[0], grad_acc_steps=MICRO, optimizer=opt)
    for step in range(STEPS):
        x, y = batch(step, dp)
        last = {"target": y, "losses": []} if count - 1 in stages else {}
        if 0 in stages:
            schedule.step(x, **last)
        else:
            schedule.step(**last)
        opt.step()
        opt.zero_grad()
    monitor.flush()
    norm, faults = monitor.last_batch.derived.global_grad_norm, monitor.faults.total
    monitor.close()
    dist.barrier()
    # torch 2.13's metadata inference runs DDP with grad; 2.11's `_shape_inference` under no_grad, where
    # DDP reduces no micro-batch (asked here: the test process itself never imports pipelining)
    reduces = not hasattr(PipelineStage, "_shape_inference")
    return {
        "run_dir": monitor.run_dir,
        "norm": norm,
        "faults": faults,
        "dp": dp,
        "inference_reduces": reduces,
    }


def _close(got: str, want: dict, stat: str) -> bool:
    scale = want["norm"] if stat != "norm" else abs(want["norm"])
    return abs(float(got) - want[stat]) <= RTOL * max(scale, 1e-12)


def _check(case: str, results: list[dict], ref: dict) -> None:
    assert [r["faults"] for r in results] == [0, 0, 0, 0]
    for r in results:  # every stage's gradients, on every rank: the pipeline's whole model
        assert abs(r["norm"] - ref["norm"][-1]) <= RTOL * ref["norm"][-1], (case, r["norm"], ref["norm"])
    for family in ("grad_reduced", "param_origin", "exp_avg"):
        writers: dict = {}
        for rank, r in enumerate(results):
            for row in read_family(r["run_dir"], family):
                writers.setdefault((row["name"], int(row["step"])), []).append((rank, row))
        assert sorted({name for name, _ in writers}) == sorted(ref["names"]), (case, family)
        for (name, step), rows in writers.items():
            assert len(rows) == 1, (case, family, name, step, [w for w, _ in rows])  # one writer
            for stat in ("norm", "min", "max", "mean"):
                assert _close(rows[0][1][stat], ref[family, name, step], stat), (
                    case,
                    family,
                    name,
                    step,
                    stat,
                )
    for family, micro_key in (("grad_unreduced", False), ("actv", True), ("actv_grad", True)):
        seen = set()
        for r in results:
            for row in read_family(r["run_dir"], family):
                step, dp = int(row["step"]), r["dp"]
                if micro_key and row["name"].endswith(".input"):  # inputs: the previous module's outputs
                    continue
                key = (family, row["name"], step, int(row["micro_step"]), dp) if micro_key else None
                key = key or (family, row["name"], step, dp)
                assert key in ref, (case, key)  # micro-steps 0..3 only: the shape inference is none
                want = ref[key]
                if (
                    family == "grad_unreduced"
                    and step == 0
                    and case.endswith("ddp")
                    and results[0]["inference_reduces"]
                ):
                    # torch 2.13's shape inference runs the DDP module outside no_sync(), which prepares
                    # DDP's reducer: the backward of micro-batch 0 is all-reduced then (the reduced
                    # gradient is right). The row is what the rank holds before its last reduce.
                    want = ref["ddp_step0", row["name"], dp]
                for stat in ("norm", "min", "max", "mean"):
                    assert _close(row[stat], want, stat), (case, key, stat, row[stat], want[stat])
                seen.add(key)
        wanted = {k for k in ref if k[0] == family}
        # grad_unreduced: each replica's own sum before the stage reduces it (DDP and FSDP2 reduce inside
        # the pipeline's schedule); actv/actv_grad: every module on every step, micro-batch and replica
        assert seen == wanted, (case, family, sorted(wanted - seen)[:4])


def _check_local_names(results: list[dict], ref: dict) -> None:
    """Stage s's "k.lin1.weight" is the whole model's "layers.{k + 2 s}.lin1.weight"."""
    assert [r["faults"] for r in results] == [0, 0, 0, 0]
    for r in results:  # both stages' gradients, though their names are the same
        assert abs(r["norm"] - ref["norm"][-1]) <= RTOL * ref["norm"][-1], (r["norm"], ref["norm"])
    writers: dict = {}
    for rank, r in enumerate(results):
        for row in read_family(r["run_dir"], "grad_reduced"):
            k, rest = row["name"].split(".", 1)
            name = f"layers.{int(k) + 2 * (rank // 2)}.{rest}"
            writers.setdefault((name, int(row["step"])), []).append(row)
    assert sorted({name for name, _ in writers}) == sorted(ref["names"])
    for (name, step), rows in writers.items():
        assert len(rows) == 1, (name, step)  # one writer per stage: the stage's DDP replicas are copies
        for stat in ("norm", "min", "max", "mean"):
            assert _close(rows[0][stat], ref["grad_reduced", name, step], stat), (name, step, stat)


def test_pp2_x_dp2_fsdp2_and_ddp_rows_match_the_whole_model(tmp_path):
    config = write_config(
        tmp_path / "c.json",
        targets={},
        xy_distribution=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=["norm", "min", "max", "mean"],
        ndigits=12,
    )
    ref = reference()
    results = run_ranks(_worker, world_size=4, timeout=600, config=config, out_dir=str(tmp_path))
    first = [r["one-rank-imports"] for r in results]
    assert [r["imported"] for r in first] == [True, False, False, False]
    assert first[0]["norm"] is not None  # DDP's replicas are copies: rank 0 writes the rows
    for r in first:
        assert r["faults"] == 0 and abs((r["norm"] or r["want"]) - r["want"]) <= RTOL * r["want"], r
    for case in CASES[:2]:
        _check(case, [r[case] for r in results], ref)
    _check_local_names([r["local-names-ddp"] for r in results], reference(with_out=False))
