"""A complex gradient sharded over ranks (FSDP2 `fully_shard`, a tensor-parallel DTensor) gets the
grad_reduced row of its moduli |z| merged over the shards, as a whole complex gradient does: the global
gradient norm is `clip_grad_norm_`'s, with no NaN and no AnomalyNan. Its parameter and optimizer-state rows
stay unwritten (a counted refusal), without a NaN or an anomaly either."""

from __future__ import annotations

import csv
import glob
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

OPS = ("norm", "mean", "min", "max", "nans")
STEPS = 2


class CLin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(torch.complex64)
        if hasattr(self.w, "device_mesh"):  # tensor parallel: the input replicated, the output gathered
            from torch.distributed.tensor import DTensor, Replicate

            return (DTensor.from_local(h, self.w.device_mesh, [Replicate()]) @ self.w.t()).full_tensor()
        return h @ self.w.t()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cx = CLin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.cx(torch.tanh(self.fc(x)))
        return z.real + 0.5 * z.imag


def _shard(model: Net, world: int, how: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.cx, mesh=mesh)  # the complex weight in a unit of its own
        fully_shard(model.fc, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # tensor parallel: the complex weight a DTensor sharded by rows, the rest plain (replicated)
        from torch.distributed.tensor import Shard, distribute_tensor

        model.cx.w = nn.Parameter(distribute_tensor(model.cx.w.data, mesh, [Shard(0)]))


def _run(rank: int, world: int, out_dir: str, how: str, families: str) -> dict[str, Any]:
    from trainermon import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    _shard(model, world, how)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = os.path.join(out_dir, "config.json")
    if rank == 0:
        keys = {"wg_distribution": True, "ops": list(OPS), "ndigits": 12}
        if families == "all":
            keys.update(mv_distribution=True, param_distribution=True)
        keys["alert"] = {"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True}
        Path(cfg).write_text(json.dumps(keys))
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    refs, norms, clip = {}, [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + (rank if how == "fsdp2" else 0))  # TP: one batch
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        # the test's reference: the whole gradients (gathered from the shards: a collective)
        full = {n: getattr(p.grad, "full_tensor", p.grad.detach)() for n, p in model.named_parameters()}
        refs[step] = ref_stats(full["cx.w"].abs())
        want = math.sqrt(sum(float((t.abs().double() ** 2).sum()) for t in full.values()))
        if how == "fsdp2":  # torch's own total as well (it refuses TP's mix of DTensor and plain grads)
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # 1e9: grads left as they are
            assert math.isclose(float(total.full_tensor()), want, rel_tol=1e-5), (total, want)
        clip.append(want)
        opt.step()
        mon.flush()
        norms.append(mon.last_batch.derived.global_grad_norm)
        opt.zero_grad()
    faults = dict(mon.faults.counts)
    anomalies = dict(mon.last_batch.derived.anomalies_total or {})
    mon.close()
    return {"run_dir": mon.run_dir, "refs": refs, "norms": norms, "clip": clip, "faults": faults,
            "anomalies": anomalies}  # fmt: skip


def _nan_rows(run_dir: str) -> list[str]:
    """The written rows with a NaN statistic (none should be: every gradient here is finite)."""
    files = glob.glob(os.path.join(run_dir, "*_[0-9]*-[0-9]*.csv"))
    assert files, run_dir
    bad = []
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                bad += [f"{f} {row['name']} {op}" for op in OPS if op in row and math.isnan(float(row[op]))]
    return bad


@pytest.mark.parametrize(("how", "families"), [("fsdp2", "grads"), ("fsdp2", "all"), ("tp", "all")])
def test_a_sharded_complex_gradient_gets_its_moduli_row_and_the_global_norm(
    tmp_path: Path, how: str, families: str
) -> None:
    results = run_ranks(_run, 2, out_dir=str(tmp_path), how=how, families=families)
    for rank, r in enumerate(results):
        for step in range(STEPS):  # every rank, every step: clip_grad_norm_'s total, not NaN
            got, want = r["norms"][step], r["clip"][step]
            assert got is not None and math.isclose(got, want, rel_tol=1e-6), (rank, step, got, want)
        assert not any(r["anomalies"].values()), r["anomalies"]
        assert not glob.glob(os.path.join(str(tmp_path), "**", f"anomaly_rank{rank}.jsonl"), recursive=True)
        if families == "grads":
            assert r["faults"] == {}, r["faults"]
        else:  # the complex parameter and its Adam moments: refused by design, counted, never a NaN row
            assert set(r["faults"]) == {"unreadable tensor (complex tensor)"}, r["faults"]
        assert _nan_rows(r["run_dir"]) == [], rank
    r0 = results[0]
    rows = keyed(read_family(r0["run_dir"], "grad_reduced"))
    assert {n for n, _, _ in rows} == {"cx.w", "fc.weight", "fc.bias"}, sorted(rows)
    for step in range(STEPS):
        assert_row_matches(rows[("cx.w", step, None)], r0["refs"][step], OPS, rtol=1e-6)
    if families == "all":
        for family in ("exp_avg", "exp_avg_sq"):
            names = {row["name"] for row in read_family(r0["run_dir"], family)}
            assert names == {"fc.weight", "fc.bias"}, (family, names)
