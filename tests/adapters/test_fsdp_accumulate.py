"""FSDP gradient accumulation where every micro-batch reduces, and FSDP1's own clipping called on an FSDP
root inside the monitored module (4 gloo ranks, one launch).

References are computed in the test: at each step a plain copy of the model is loaded with FSDP's gathered
parameters (summon_full_params / full_tensor) and run on this rank's micro-batches; its gradients are the
rank's own (grad_unreduced: their sum over the step's micro-batches) and, averaged over the ranks with an
all_reduce, the reduced gradient before any clipping (grad_reduced, the global norm).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 3
ACC = 2
CASES: list[dict[str, Any]] = [
    # Lightning's FSDP accumulation: no no_sync(), every micro-batch reduce-scatters.
    {"id": "fsdp1-acc-sync", "fsdp": 1, "acc": ACC},
    # FSDP2 HSDP (2 replicas x 2 shards): reduce-scatter every micro-batch, all-reduce at the last.
    {"id": "fsdp2-hsdp-rs-only", "fsdp": 2, "acc": ACC},
    # As the first, with the loop's own skip at step 1 (NaN loss, zero_grad without opt.step()): the step
    # closed without the optimizer's pre-step still gets its summed grad_unreduced rows.
    # (flat parameters: every rank sees the non-finite gradient, the evidence of the loop's own skip)
    {"id": "fsdp1-acc-skip", "fsdp": 1, "acc": ACC, "skip": 1, "orig": False},
    # FSDP1's clip_grad_norm_ called on the FSDP root that the monitored (plain) module holds.
    {"id": "fsdp1-clip-inner-root", "fsdp": 1, "acc": 1, "clip": 1e-3},
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.block = nn.Sequential(nn.Linear(12, 12), nn.Tanh())
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.relu(self.inp(x))))


class Holder(nn.Module):
    """A LightningModule-like chunk: a plain module whose `net` is the FSDP root."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _wrap(case: dict[str, Any], model: Net) -> tuple[nn.Module, nn.Module]:
    """(the module given to the monitor, the FSDP root)."""
    if case["fsdp"] == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        root = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
            use_orig_params=case.get("orig", True),
            device_id=torch.device("cpu"),
        )
        return (Holder(root) if "clip" in case else root), root
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.block, mesh=mesh)
    return model, fully_shard(model, mesh=mesh)


def _gathered(case: dict[str, Any], root: nn.Module) -> dict[str, torch.Tensor]:
    from trainermon.names import clean_name

    if case["fsdp"] == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(root):
            return {clean_name(n): p.detach().clone() for n, p in root.named_parameters()}
    return {clean_name(n): p.full_tensor().detach().clone() for n, p in root.named_parameters()}


def _run_case(case: dict[str, Any], rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from trainermon import TrainerMon

    torch.manual_seed(0)
    monitored, root = _wrap(case, Net())
    opt = torch.optim.SGD(root.parameters(), lr=0.05)
    cfg = os.path.join(out_dir, "config.json")
    if rank == 0:
        Path(cfg).write_text(json.dumps({"targets": {}, "wg_distribution": True, "ops": list(OPS)}))
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(cfg)
    monitor.set_monitor(monitored, grad_acc_steps=case["acc"], optimizer=opt)
    refs: dict = {}
    norms: list[float] = []
    for step in range(STEPS):
        plain = Net()
        plain.load_state_dict(_gathered(case, root))
        micro_grads = []
        for micro in range(case["acc"]):
            plain.zero_grad()
            x, y = _batch(step, rank, micro)
            _loss(plain(x), y).backward()
            micro_grads.append({n: p.grad.clone() for n, p in plain.named_parameters()})
        total_sq = 0.0
        for name in micro_grads[0]:
            local = sum(g[name] for g in micro_grads)
            refs[("grad_unreduced", name, step)] = ref_stats(local)
            refs[("grad_unreduced_first", name, step)] = ref_stats(micro_grads[0][name])
            reduced = local.clone()
            dist.all_reduce(reduced)
            reduced /= world
            refs[("grad_reduced", name, step)] = ref_stats(reduced)
            total_sq += float(reduced.double().pow(2).sum())
        norms.append(math.sqrt(total_sq))
        for micro in range(case["acc"]):
            last = micro == case["acc"] - 1
            if case["fsdp"] == 2:
                root.set_requires_all_reduce(last)  # reduce-scatter every micro-batch
            x, y = _batch(step, rank, micro)
            loss = _loss(monitored(x), y)
            if last and case.get("skip") == step:
                loss = loss * float("nan")
            loss.backward()
        if case.get("skip") == step:
            opt.zero_grad()  # the loop's own skip on non-finite gradients
            continue
        if "clip" in case:
            root.clip_grad_norm_(case["clip"])  # FSDP1's own method, on the inner root
        opt.step()
        opt.zero_grad()
    monitor.flush()
    batch = monitor.last_batch
    result = {
        "run_dir": monitor.run_dir,
        "refs": refs,
        "norms": norms,
        "global_norm": None if batch is None else batch.derived.global_grad_norm,
        "faults": monitor.faults.total,
    }
    monitor.close()
    return result


def _matrix(rank: int, world: int, out_root: str) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        out_dir = os.path.join(out_root, case["id"])
        os.makedirs(out_dir, exist_ok=True)
        out[case["id"]] = _run_case(case, rank, world, out_dir)
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_matrix, world_size=4, out_root=str(tmp_path_factory.mktemp("fsdp_acc")))


def _rows(run_dir: str, family: str) -> dict[tuple, dict[str, str]]:
    """Rows keyed by (name relative to the FSDP root, step)."""
    return {
        (name.removeprefix("net."), step): row
        for (name, step, _micro), row in keyed(read_family(run_dir, family)).items()
    }


@pytest.mark.parametrize("case", CASES[:3], ids=[c["id"] for c in CASES[:3]])
def test_unreduced_is_the_sum_over_reduces(matrix: list, case: dict[str, Any]) -> None:
    """Every micro-batch reduces: grad_unreduced is this rank's whole step contribution (the sum of its
    micro-batch gradients), from the step after the one that showed the repeated reduce (documented)."""
    for results in matrix:
        result = results[case["id"]]
        assert result["faults"] == 0
        rows = _rows(result["run_dir"], "grad_unreduced")
        names = {name for (_f, name, _s) in result["refs"]}
        assert set(rows) == {(n, s) for n in names for s in range(STEPS)}, sorted(rows)
        for (name, step), row in rows.items():
            if step == case.get("skip"):
                assert row["norm"] == "nan", row  # the skipped step's rows are there, NaN as its gradients
                continue
            family = "grad_unreduced_first" if step == 0 else "grad_unreduced"
            assert_row_matches(row, result["refs"][(family, name, step)], OPS, rtol=1e-5)


def test_fsdp1_clip_on_inner_root_reads_pre_clip(matrix: list) -> None:
    """grad_reduced rows and the global norm are the gradients before FSDP1's own clipping."""
    case = "fsdp1-clip-inner-root"
    r0 = matrix[0][case]
    rows = _rows(r0["run_dir"], "grad_reduced")
    names = {name for (f, name, _s) in r0["refs"] if f == "grad_reduced"}
    assert set(rows) == {(n, s) for n in names for s in range(STEPS)}, sorted(rows)
    for (name, step), row in rows.items():
        assert_row_matches(row, r0["refs"][("grad_reduced", name, step)], OPS, rtol=1e-5)
    assert r0["global_norm"] == pytest.approx(r0["norms"][-1], rel=1e-5)
    assert all(r[case]["faults"] == 0 for r in matrix)
