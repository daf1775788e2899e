"""DTensor on N-D meshes and FSDP1's hybrid strategies, on 4 gloo ranks in one launch.

Layouts: HSDP 2x2 (replicate x shard); FSDP2 over a tensor-parallel model as torchtitan composes them
(2x2 ("dp", "tp"), Colwise + Rowwise, and Colwise-only, where FSDP2 shards the TP dimension again:
`_StridedShard`); tensor parallelism alone over 4 ranks (`parallelize_module`, the plain torch adapter);
the same FSDP2 + TP on a 3-D mesh 2x1x2 (a dimension of size 1); FSDP1 HYBRID_SHARD and NO_SHARD.

For every layout and step, against full tensors the test builds itself (`full_tensor()`, FSDP1's
`summon_full_params`): every optimizer-side row (grad_reduced, param_origin, param_updated, and the
moments for DTensor layouts) with its full shape and values, written by exactly one rank of the job; the
sum of written grad_reduced norm^2 and the monitor's global norm against torch's `clip_grad_norm_` (or
FSDP1's), which clips every step (max_norm below the norm: the rows are read before it scales them); the
pre-reduce gradient of a tensor-parallel weight present on every rank with its piece labelled; and the
losses bit-identical to the same run without the monitor.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

from tests.distributed import run_ranks
from tests.helpers import read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 2
MAX_NORM = 1e-3  # below every step's gradient norm: the clipping scales the gradients in place
D, HIDDEN = 8, 32
CASES = (
    "hsdp",
    "hsdp-bf16",
    "fsdp2-tp",
    "fsdp2-tp-colwise",
    "tp-only",
    "tp-dp-replicate",
    "fsdp2-tp-3d",
    "fsdp1-hybrid",
    "fsdp1-hybrid-zero2",
    "fsdp1-noshard",
)
DTENSOR_CASES = tuple(c for c in CASES if not c.startswith("fsdp1"))


def _model():
    import torch
    from torch import nn

    class FFN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(D, HIDDEN)
            self.w2 = nn.Linear(HIDDEN, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w2(torch.nn.functional.gelu(self.w1(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.full((1,), 0.9))  # some rank holds no element of it
            self.inp = nn.Linear(6, D)
            self.layers = nn.ModuleList([FFN(), FFN()])
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, 3)  # 3 rows over 2 shards: uneven

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x) * self.scale
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Net()


def _build(case: str, rank: int):
    """(model, data-parallel coordinate): the batch depends on it only."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    if case in ("hsdp", "hsdp-bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": mp} if case == "hsdp-bf16" else {}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        return model, rank  # every rank its own data
    if case in ("fsdp2-tp", "fsdp2-tp-colwise", "fsdp2-tp-3d"):
        if case == "fsdp2-tp-3d":
            mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        from torch.distributed.tensor import Replicate

        plan = (
            {"w1": ColwiseParallel(output_layouts=Replicate())}
            if case == "fsdp2-tp-colwise"
            else {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        )
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank()
    if case == "tp-only":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        for layer in model.layers:
            parallelize_module(layer, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        return model, 0  # one replica: every rank the same data
    if case == "tp-dp-replicate":
        # 2 x 2 ("dp", "tp"): tensor parallelism on the "tp" sub-mesh, data parallelism by averaging the
        # gradients over "dp" (`_average_over_dp`); the parameters never name "dp": they are copies there
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        model._dp_group = mesh["dp"].get_group()
        return model, mesh["dp"].get_local_rank()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    if case in ("fsdp1-hybrid", "fsdp1-hybrid-zero2"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        strategy = (
            ShardingStrategy._HYBRID_SHARD_ZERO2 if case.endswith("zero2") else ShardingStrategy.HYBRID_SHARD
        )
        return FSDP(
            model,
            sharding_strategy=strategy,
            device_mesh=mesh,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        ), rank
    import torch.distributed as dist

    return FSDP(
        model,
        sharding_strategy=ShardingStrategy.NO_SHARD,
        process_group=dist.group.WORLD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
    ), rank


def _average_over_dp(model) -> None:
    """The "tp-dp-replicate" case's data parallelism: every gradient averaged over the dp group."""
    import torch.distributed as dist

    group = getattr(model, "_dp_group", None)
    if group is None:
        return
    for p in model.parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=group)
        local.div_(dist.get_world_size(group))


def _full(t):
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _fsdp1_full(model, with_grads: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from trainermon.names import clean_name

    out = {}
    with FSDP.summon_full_params(model, with_grads=with_grads):
        for name, p in model.named_parameters():
            out[clean_name(name)] = (p.grad if with_grads else p).detach().float().clone()
    return out


def _dtensor_full(model, what: str, optimizer=None) -> dict:
    from trainermon.names import clean_name

    out = {}
    for name, p in model.named_parameters():
        if what == "param":
            value = p
        elif what == "grad":
            value = p.grad
        else:
            value = optimizer.state[p][what]
        out[clean_name(name)] = _full(value)
    return out


def _train(case: str, rank: int, out_root: str | None) -> dict:
    import torch
    import torch.distributed as dist

    from trainermon import TrainerMon

    model, dp = _build(case, rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if out_root is not None:
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, case)
        cfg = os.path.join(out_root, f"{case}-{rank}.json")
        with open(cfg, "w") as fh:
            body = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
            json.dump({**body, "ops": list(OPS), "ndigits": 12}, fh)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    dtensor = case in DTENSOR_CASES
    refs, norms, losses, derived, clipped = {}, [], [], [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + dp)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        optimizer.zero_grad()
        # float32 loss on the (bf16 under hsdp-bf16) output: torch 2.11's mse_loss backward rejects a bf16
        # input with a float32 target ("Found dtype Float but expected BFloat16"); 2.13 accepts it
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        _average_over_dp(model)
        losses.append(loss.item())
        if monitor is None:
            _clip(model, dtensor)  # as the monitored run does: the losses must stay bit-identical
            optimizer.step()
            continue
        if dtensor:
            params, grads = _dtensor_full(model, "param"), _dtensor_full(model, "grad")
        else:
            params, grads = _fsdp1_full(model, False), _fsdp1_full(model, True)
        norm, how = _clip(model, dtensor)
        clipped.append(how)
        norms.append(norm)
        optimizer.step()
        after = {"param_updated": _dtensor_full(model, "param") if dtensor else _fsdp1_full(model, False)}
        if dtensor:
            after["exp_avg"] = _dtensor_full(model, "exp_avg", optimizer)
            after["exp_avg_sq"] = _dtensor_full(model, "exp_avg_sq", optimizer)
        for family, tensors in {"grad_reduced": grads, "param_origin": params, **after}.items():
            for name, t in tensors.items():
                refs[(family, name, step)] = {**ref_stats(t), "shape": list(t.shape)}
        monitor.flush()
        derived.append(monitor.last_batch.derived.global_grad_norm)
    if monitor is not None:
        monitor.close()
    dist.barrier()
    return {
        "run_dir": None if monitor is None else monitor.run_dir,
        "refs": refs,
        "norms": norms,
        "derived": derived,
        "clipped": clipped,
        "losses": losses,
        "faults": {} if monitor is None else dict(monitor.faults.counts),
    }


def _clip(model, dtensor: bool) -> tuple[float, str]:
    """Clips the gradients to MAX_NORM as the job's framework does; the norm before clipping, and how.
    torch 2.13's `clip_grad_norm_` cannot stack the norms of DTensors on different meshes (tensor
    parallelism here): the norm is then summed per gradient, and the gradients scaled by torch's public
    `clip_grads_with_norm_` (torchtitan's way), once per mesh (one call cannot mix meshes either)."""
    import torch

    if not dtensor:
        return float(model.clip_grad_norm_(MAX_NORM)), "fsdp1"
    try:
        return float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))), "norm_"
    except RuntimeError:
        pass
    params = [p for p in model.parameters() if p.grad is not None]
    total = math.sqrt(sum(float(_full(p.grad).double().pow(2).sum()) for p in params))
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, MAX_NORM, torch.tensor(total))
    return total, "with_norm_"


def _partial(rank: int) -> dict:
    """A `Partial` DTensor (each rank a summand): reduced first, then one row of the full tensor."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from trainermon.adapters.dtensor import dtensor_piece
    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.collect.records import StepScalars
    from trainermon.stats import EngineOptions, StatsEngine, finalize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    summand = torch.arange(12, dtype=torch.float32).reshape(2, 6) * (rank + 1)  # this rank's Shard(0) rows
    t = DTensor.from_local(summand, mesh, [Partial(), Shard(0)])
    collector = StepCollector(StatsEngine(EngineOptions(nonfinite=True)), TransferCounter())
    collector.add("param_updated", [(0, "p", None, dtensor_piece(t))])
    payload = collector.finish(0, StepScalars())
    values = finalize(payload.partials.numpy(), np.array([r.numel for r in payload.rows], dtype=np.float64))
    full = t.full_tensor()
    return {
        "rows": [(r.name, list(r.shape)) for r in payload.rows],
        "norm": [float(v) for v in values["norm"]],
        "want": float(full.double().norm()),
    }


def _matrix(rank: int, world: int, out_root: str) -> dict:
    from trainermon.stats import partials

    out = {"partial": _partial(rank)}
    gather_bytes, reduce_merge = partials.GATHER_BYTES, partials._reduce_merge
    merges: list[int] = []
    partials._reduce_merge = lambda *args: merges.append(1) or reduce_merge(*args)  # counted
    for case in CASES:
        # the 3-D case merges as a job of thousands of ranks does: all-reduces instead of all-gathers
        partials.GATHER_BYTES = 0 if case == "fsdp2-tp-3d" else gather_bytes
        merges.clear()
        monitored = _train(case, rank, out_root)
        monitored["reduce_merges"] = len(merges)
        monitored["plain_losses"] = _train(case, rank, None)["losses"]
        out[case] = monitored
    return out


def _check(results: list[dict], case: str) -> None:
    per_rank = [r[case] for r in results]
    for rank, res in enumerate(per_rank):
        assert res["faults"] == {}, (case, rank, res["faults"])
        assert res["losses"] == res["plain_losses"], (case, rank, res["losses"], res["plain_losses"])
        assert (res["reduce_merges"] > 0) == (case == "fsdp2-tp-3d"), (case, rank, res["reduce_merges"])
    refs = {}
    for res in per_rank:
        refs.update(res["refs"])
    families = sorted({f for f, _, _ in refs})
    wrong = []
    for family in families:
        rows = [(r, row) for r, res in enumerate(per_rank) for row in read_family(res["run_dir"], family)]
        writers = Counter((row["name"], int(row["step"])) for _, row in rows)
        assert all(n == 1 for n in writers.values()), (
            case,
            family,
            [k for k, n in writers.items() if n > 1][:5],
        )
        expected = {(n, s) for f, n, s in refs if f == family}
        assert set(writers) == expected, (case, family, sorted(expected ^ set(writers))[:6])
        for _, row in rows:
            ref = refs[(family, row["name"], int(row["step"]))]
            assert json.loads(row["shape"]) == ref["shape"], (case, family, row["name"], row["shape"])
            for op in OPS:
                got, want = float(row[op]), ref[op]
                rms = ref["norm"] / math.sqrt(math.prod(ref["shape"]))
                if abs(got - want) > 1e-5 * abs(want) + 1e-6 * rms + 1e-12:
                    wrong.append((family, row["name"], row["step"], op, got, want))
    assert not wrong, (case, len(wrong), wrong[:5])
    for step in range(STEPS):
        torch_norm = per_rank[0]["norms"][step]
        assert torch_norm > 10 * MAX_NORM  # where the clipping ran, it did scale the gradients
        rows = [row for res in per_rank for row in read_family(res["run_dir"], "grad_reduced")]
        total = math.sqrt(sum(float(r["norm"]) ** 2 for r in rows if int(r["step"]) == step))
        assert abs(total - torch_norm) <= 1e-5 * torch_norm, (case, step, total, torch_norm)
    for rank, res in enumerate(per_rank):
        got = res["derived"][-1]
        if got is not None or case in DTENSOR_CASES:  # every rank knows it where the model is split
            assert got is not None and abs(got - per_rank[0]["norms"][-1]) <= 1e-5 * got, (case, rank, got)
    if "tp" in case:
        for rank, res in enumerate(per_rank):
            rows = [
                r for r in read_family(res["run_dir"], "grad_unreduced") if r["name"] == "layers.0.w1.weight"
            ]
            assert len(rows) == STEPS, (case, rank, len(rows))
            assert all("[tp=" in r["shard"] for r in rows), (case, rank, rows[0]["shard"])


def test_dtensor_and_hybrid_layouts_on_four_ranks(tmp_path: Path) -> None:
    # fresh interpreters: each rank its own string-hash seed, as under torchrun
    results = run_ranks(_matrix, world_size=4, timeout=900, fresh_interpreters=True, out_root=str(tmp_path))
    failures = []
    partial = [r["partial"] for r in results]
    assert partial[0]["rows"] == [("p", [4, 6])] and all(not p["rows"] for p in partial[1:]), partial
    assert math.isclose(partial[0]["norm"][0], partial[0]["want"], rel_tol=5e-7), partial[0]
    for case in CASES:
        try:
            _check(results, case)
        except AssertionError as exc:
            failures.append(f"{case}: {str(exc)[:600]}")
    assert not failures, "\n".join(failures)
    # All three ways of clipping ran: torch's clip_grad_norm_, clip_grads_with_norm_, FSDP1's method
    assert {how for case in CASES for how in results[0][case]["clipped"]} == {"norm_", "with_norm_", "fsdp1"}
