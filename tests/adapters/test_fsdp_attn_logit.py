"""attn_logit under FSDP2 (fully_shard per block and at the root), 2 gloo ranks, each with its own batch:
the row rank 0 writes holds, per head, the max over both ranks' batches of an explicit float64 q.k^T the
test computes from each call's inputs and the module's unsharded weights (its own pre-hook, registered
after fully_shard's, so the weights are whole), causal mask excluded."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

HEADS, DIM, SEQ, STEPS = 4, 16, 9, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


def _run(rank: int, world_size: int, out_root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"c{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"attn_logit_distribution": True, "ops": ["max"]}, fh)
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    tops: dict[str, torch.Tensor] = {}
    bound = [0.0]

    def reference(name: str, m: nn.MultiheadAttention, args: tuple) -> None:
        x = args[0].detach().double()
        w, b = m.in_proj_weight.detach().double(), m.in_proj_bias.detach().double()
        assert w.shape == (3 * DIM, DIM)  # whole: fully_shard's pre-forward hook ran first
        q = (x @ w[:DIM].T + b[:DIM]).view(x.shape[0], SEQ, HEADS, -1).transpose(1, 2)
        k = (x @ w[DIM : 2 * DIM].T + b[DIM : 2 * DIM]).view(x.shape[0], SEQ, HEADS, -1).transpose(1, 2)
        scale = 1 / math.sqrt(DIM // HEADS)
        logits = (q @ k.transpose(-1, -2)) * scale
        hidden = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
        top = logits.masked_fill(hidden, -math.inf).amax(dim=(0, 2, 3))
        tops[name] = top if name not in tops else torch.maximum(tops[name], top)
        bound[0] = max(bound[0], float(((q.abs() @ k.abs().transpose(-1, -2)) * scale).max()))

    for i, block in enumerate(model):
        block.attn.register_forward_pre_hook(lambda m, a, n=f"{i}.attn": reference(n, m, a))
    refs = {}
    for step in range(STEPS):
        tops.clear()
        gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        model(torch.randn(3, SEQ, DIM, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for name, top in sorted(tops.items()):
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            refs[f"{name}@{step}"] = top.tolist()
    b = torch.tensor([bound[0]], dtype=torch.float64)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    mon.close()
    return {"run_dir": mon.run_dir, "refs": refs, "bound": float(b), "faults": dict(mon.faults.counts)}


def test_fsdp2_attention_logits_over_both_ranks(tmp_path: Path) -> None:
    results = run_ranks(_run, world_size=2, timeout=300, out_root=str(tmp_path))
    assert [r["faults"] for r in results] == [{}, {}]
    refs = results[0]["refs"]
    assert refs == results[1]["refs"]
    assert read_family(results[1]["run_dir"], "attn_logit") == []  # rank 0 writes the merged rows
    rows = {f"{r['name']}@{r['step']}": r for r in read_family(results[0]["run_dir"], "attn_logit")}
    assert set(rows) == set(refs) and len(refs) == 2 * STEPS
    tol = 8 * (DIM + DIM // HEADS) * 2.0**-24 * results[0]["bound"]  # float32 projections and dots
    for key, row in rows.items():
        np.testing.assert_allclose(
            json.loads(row["head_max_logit"]), refs[key], rtol=0, atol=tol, err_msg=key
        )
