"""Sequence parallelism and flattened meshes, as torchtitan lays them out, on 2 gloo ranks in one launch.

- "tp-sp": tensor parallelism with SequenceParallel norms (torchtitan's plan: the norms' weight gradients
  are `Partial(sum)` over the TP group until the optimizer step). Every optimizer-side row against the
  full tensors (`full_tensor()`); the norms' unreduced gradient is this rank's summand, labelled so; and
  the collectives the monitor issues per collected step: the Partial gradients reduced in one packed
  all-reduce on the TP group (it was two all-reduces per gradient, one per family), none through DTensor.
- "fsdp2-flat": FSDP2 on a mesh flattened from ("dp_shard", "cp") into "dp_shard_cp" (torchtitan's FSDP
  mesh). The rows were rank 0's shard alone (half the norm of a 2-way shard): the root dimension the
  flattened mesh does not name was taken for one it holds copies on.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from pathlib import Path

from tests.adapters.test_nd_collectives import COLLECTIVES, _from_monitor
from tests.distributed import run_ranks
from tests.helpers import read_family, ref_stats
from trainermon.stats.partials import GATHER_OP

OPS = ("norm", "mean", "min", "max")
STEPS = 3
B, S, D, H, V = 2, 4, 8, 16, 5
FAMILIES = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.w1, self.w2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.w2(torch.nn.functional.gelu(self.w1(self.norm(h))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, D)
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, V)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # norms away from their initial ones and zeros: their rows then tell apart
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _build(case: str):
    """(model, data-parallel coordinate, whether tensor-parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if case == "fsdp2-flat":
        root = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "cp"))
        mesh = root["dp_shard", "cp"]._flatten("dp_shard_cp")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh.get_local_rank(), False
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(
        model,
        mesh,
        {
            "inp": ColwiseParallel(output_layouts=Shard(1)),
            "layers.1": PrepareModuleInputOutput(
                input_layouts=Shard(1),
                desired_input_layouts=Shard(1),
                use_local_input=True,
                output_layouts=Shard(1),
                desired_output_layouts=Shard(1),
                use_local_output=True,
            ),
            "norm": SequenceParallel(use_local_output=True),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model, 0, True


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


def _train(rank: int, case: str, out_root: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from trainermon import TrainerMon
    from trainermon.names import clean_name

    model, dp, tensor_parallel = _build(case)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, case)
    cfg = os.path.join(out_root, f"{case}-{rank}.json")
    with open(cfg, "w") as fh:
        body = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
        json.dump({**body, "ops": list(OPS), "ndigits": 12}, fh)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    def label(group) -> str:  # the TP mesh spans both ranks: its group is the default one
        return "world" if group is None or group is dist.group.WORLD else "cpu"  # cpu: gloo's copy

    calls: dict[str, list[str]] = defaultdict(list)
    wrapped = [(dist, name) for name in COLLECTIVES if hasattr(dist, name)]
    wrapped += [(funcol, name) for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")]
    originals = [(module, name, getattr(module, name)) for module, name in wrapped]

    def wrap(module, name, fn):
        def counted(*args, **kwargs):
            if _from_monitor():
                where = "funcol" if module is funcol else label(kwargs.get("group"))
                calls[where].append(name)
            return fn(*args, **kwargs)

        return counted

    refs, per_step, unreduced = {}, [], []
    for module, name, fn in originals:
        setattr(module, name, wrap(module, name, fn))
    try:
        for step in range(STEPS):
            calls.clear()
            gen = torch.Generator().manual_seed(100 * step + dp)
            x, y = torch.randn(B, S, 6, generator=gen), torch.randn(B, S, V, generator=gen)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            before = {
                "grad_reduced": {n: _full(p.grad) for n, p in model.named_parameters()},
                "param_origin": {n: _full(p) for n, p in model.named_parameters()},
            }
            grad = model.layers[0].norm.weight.grad
            unreduced.append((str(grad.placements), ref_stats(grad.to_local()) if tensor_parallel else None))
            optimizer.step()
            after = {
                "param_updated": {n: _full(p) for n, p in model.named_parameters()},
                "exp_avg": {n: _full(optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters()},
                "exp_avg_sq": {
                    n: _full(optimizer.state[p]["exp_avg_sq"]) for n, p in model.named_parameters()
                },
            }
            for family, tensors in {**before, **after}.items():
                for name, t in tensors.items():
                    refs[(family, clean_name(name), step)] = {**ref_stats(t), "shape": list(t.shape)}
            per_step.append({k: list(v) for k, v in calls.items()})
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    monitor.close()
    dist.barrier()
    return {
        "run_dir": monitor.run_dir,
        "refs": refs,
        "calls": per_step,
        "unreduced": unreduced,
        "faults": dict(monitor.faults.counts),
    }


def _activations(rank: int, out_root: str) -> dict:
    """One collected step of activations on the tp-sp model; each module's output as this rank's forward
    returns it (a hook after every other: torch's styles have made it local by then)."""
    import torch

    from trainermon import TrainerMon

    model, _, _ = _build("tp-sp")
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "actv")
    cfg = os.path.join(out_root, f"actv-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"xy_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    monitor = TrainerMon(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    seen = {}

    def keep(name: str, t) -> None:  # a forward hook's return value would replace the output
        seen.setdefault(name, t)

    for name in ("inp", "layers.0.w1", "layers.0.w2", "layers.0.norm", "layers.1", "norm", "head"):
        module = model.get_submodule(name)
        module.register_forward_hook(lambda m, i, out, name=name: keep(f"{name}.output", out))
    model.layers[1].register_forward_hook(lambda m, i, out: keep("layers.1.input", i[0]))
    x = torch.randn(B, S, 6, generator=torch.Generator().manual_seed(7))
    model(x).pow(2).mean().backward()
    optimizer.step()
    monitor.close()
    outputs = {}
    for name, out in seen.items():
        local = out.to_local() if hasattr(out, "to_local") else out
        outputs[name] = {**ref_stats(local.detach().double()), "dtensor": hasattr(out, "to_local")}
    rows = {r["name"]: r for r in read_family(monitor.run_dir, "actv")}
    return {"outputs": outputs, "rows": rows, "grads": read_family(monitor.run_dir, "actv_grad")}


def _both(rank: int, world: int, out_root: str) -> dict:
    out = {case: _train(rank, case, out_root) for case in ("tp-sp", "fsdp2-flat")}
    out["actv"] = _activations(rank, out_root)
    return out


def _check_rows(per_rank: list[dict], case: str) -> None:
    refs = per_rank[0]["refs"]
    wrong = []
    for family in FAMILIES:
        rows = [row for res in per_rank for row in read_family(res["run_dir"], family)]
        writers = Counter((row["name"], int(row["step"])) for row in rows)
        expected = {(n, s) for f, n, s in refs if f == family}
        assert set(writers) == expected and set(writers.values()) == {1}, (case, family, writers)
        for row in rows:
            ref = refs[(family, row["name"], int(row["step"]))]
            assert json.loads(row["shape"]) == ref["shape"], (case, family, row["name"])
            rms = ref["norm"] / math.sqrt(math.prod(ref["shape"]))
            for op in OPS:  # float32 statistics of float32 values: ~1e-7 relative, bounded at 1e-5
                got, want = float(row[op]), ref[op]
                if abs(got - want) > 1e-5 * abs(want) + 1e-6 * rms + 1e-12:
                    wrong.append((family, row["name"], row["step"], op, got, want))
    assert not wrong, (case, len(wrong), wrong[:5])


def test_sequence_parallel_and_flattened_mesh_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_both, world_size=2, timeout=900, out_root=str(tmp_path))
    for case in ("tp-sp", "fsdp2-flat"):
        per_rank = [r[case] for r in results]
        assert all(res["faults"] == {} for res in per_rank), [res["faults"] for res in per_rank]
        _check_rows(per_rank, case)
    for rank, res in enumerate(r["tp-sp"] for r in results):
        # the layout under test: the norms' gradients are Partial when the monitor reads them
        assert all(placements == "(Partial(sum),)" for placements, _ in res["unreduced"]), res["unreduced"]
        rows = read_family(res["run_dir"], "grad_unreduced")
        rows = [r for r in rows if r["name"] == "layers.0.norm.weight"]
        assert [r["shard"] for r in rows] == [f"Partial(sum)[tp={rank}/2]"] * STEPS, rows
        for row, (_, want) in zip(rows, res["unreduced"]):
            for op in OPS:
                assert math.isclose(float(row[op]), want[op], rel_tol=1e-5, abs_tol=1e-9), (rank, op, row)
        for step, calls in enumerate(res["calls"][1:], start=1):  # after the first step's layout check
            assert "funcol" not in calls, (rank, step, calls)  # no DTensor redistribution per tensor
            # one packed all-reduce of the Partial gradients, one packed all-gather of the statistics, the
            # cross-rank summaries' all-gather; on gloo's copy of the group, the layout check's all-reduce
            assert Counter(calls["world"]) == {"all_reduce": 1, GATHER_OP: 2}, (rank, calls)
            assert calls["cpu"] == ["all_reduce"], (rank, step, calls)
    # Outputs that torch's styles hand on as this rank's plain piece carry their shard label, as a
    # DTensor output does (they were unlabelled: nothing said that TP peers' rows are different pieces)
    labels = {
        "inp.output": "Shard(1)",  # ColwiseParallel(output_layouts=Shard(1)), made local
        "layers.0.w1.output": "Shard(-1)",  # ColwiseParallel(): Shard(-1), made local
        "layers.0.w2.output": "Shard(1)",  # RowwiseParallel(output_layouts=Shard(1)), made local
        "layers.0.norm.output": "Shard(1)",  # SequenceParallel(): stays a DTensor
        "layers.1.input": "Shard(1)",  # PrepareModuleInputOutput(..., use_local_input=True), made local
        "layers.1.output": "Shard(1)",  # and its use_local_output=True
        "norm.output": "Shard(1)",  # SequenceParallel(use_local_output=True), made local
        "head.output": None,  # Replicate(), made local: the whole tensor
    }
    for rank, res in enumerate(r["actv"] for r in results):
        for name, kind in labels.items():
            row, want = res["rows"][name], res["outputs"][name]
            assert row["shard"] == (f"{kind}[tp={rank}/2]" if kind else ""), (rank, name, row["shard"])
            assert want["dtensor"] == (name == "layers.0.norm.output"), (rank, name)
            for op in OPS:  # this rank's values, float32 statistics of <= 64 float32 values
                assert math.isclose(float(row[op]), want[op], rel_tol=1e-5, abs_tol=1e-7), (rank, name, op)
        # their gradients are the same pieces of the full gradient
        grads = {row["name"]: row["shard"] for row in res["grads"]}
        for name in ("layers.1.input", "layers.1.output", "norm.output"):
            assert grads[name] == f"Shard(1)[tp={rank}/2]", (rank, name, grads[name])
